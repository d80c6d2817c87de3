"""Two emulated hosts on this machine: network namespaces joined by a veth
pair, optionally rate-limited with tc tbf, whose link can be cut and
restored. Everything made here is removed on exit. Addresses are
link-local (169.254.77.0/24), inside namespaces this process created.

    with TwoHosts(rate="1gbit") as net:
        net.run_in("a", argv) ...; net.cut(); net.restore()
"""
import os
import subprocess

ADDR = {"a": "169.254.77.1", "b": "169.254.77.2"}


class Unavailable(Exception):
    pass


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise Unavailable(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


class TwoHosts:
    def __init__(self, rate=None):
        tag = f"{os.getpid() % 100000}"
        self.ns = {"a": f"qmigd-a{tag}", "b": f"qmigd-b{tag}"}
        self.dev = {"a": f"qva{tag}", "b": f"qvb{tag}"}
        self.rate = rate

    def __enter__(self):
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        try:
            for h in ("a", "b"):
                _ip("netns", "add", self.ns[h])
            _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
            for h in ("a", "b"):
                _ip("link", "set", self.dev[h], "netns", self.ns[h])
                _ip("-n", self.ns[h], "addr", "add", ADDR[h] + "/24", "dev", self.dev[h])
                _ip("-n", self.ns[h], "link", "set", "lo", "up")
                _ip("-n", self.ns[h], "link", "set", self.dev[h], "up")
                if self.rate:
                    r = subprocess.run(["tc", "-n", self.ns[h], "qdisc", "add", "dev", self.dev[h],
                                        "root", "tbf", "rate", self.rate, "burst", "1mbit",
                                        "latency", "50ms"], capture_output=True, text=True)
                    if r.returncode != 0:
                        raise Unavailable(f"tc tbf: {r.stderr.strip()}")
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        for h in ("a", "b"):
            _ip("netns", "del", self.ns[h], check=False)  # takes the veth pair along

    def wrap(self, host):
        """The argv prefix that runs a command on `host`."""
        return ["ip", "netns", "exec", self.ns[host]]

    def addr(self, host):
        return ADDR[host]

    def cut(self):
        _ip("-n", self.ns["a"], "link", "set", self.dev["a"], "down")

    def restore(self):
        _ip("-n", self.ns["a"], "link", "set", self.dev["a"], "up")
