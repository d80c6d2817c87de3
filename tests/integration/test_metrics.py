#!/usr/bin/env python3
"""--metrics: /metrics in Prometheus' text format, read by the real thing.
promtool checks the exposition before, during and after a migration; a
Prometheus (Debian's) scrapes a qmigd source and destination every second
through a migration and its HTTP API must show the migration active, then
the last migration completed with its totals, on both sides. Also: bad
--metrics addresses are refused at start, and what a scrape costs."""
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request

from itest import test, main, check, skip
from fixtures import images, MiB
from runner import (Peer, QMIGD, free_port, start_incoming, wait_status, files_equal, end_process,
                    migrate, unique_name, stop_all)
from qmp import QMP
from waiting import wait_until, accept_queue

SIZE = 64 * MiB


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def metrics_peers(imgs, size=SIZE):
    sp, dp = free_port(), free_port()
    s = Peer("qmigd", "source", [("mem", imgs[0][1], size)], "m-src",
             ["--metrics", f"127.0.0.1:{sp}"])
    d = Peer("qmigd", "dest", [("mem", imgs[0][2], size)], "m-dst",
             ["--metrics", f"tcp:127.0.0.1:{dp}"])
    return s, d, f"http://127.0.0.1:{sp}/metrics", f"http://127.0.0.1:{dp}/metrics"


def value(text, series):
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {series} in:\n{text}")


def promtool_check(text):
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True)
    check(r.returncode == 0, f"promtool: {r.stdout}{r.stderr}")


@test
def test_exposition_passes_promtool():
    """Before, during and after a migration the text passes promtool, and
    the figures follow the migration (the last one's kept after it)."""
    if not shutil.which("promtool"):
        skip("promtool is not installed (scripts/install-deps.sh installs prometheus)")
    with images(SIZE, "mixed") as imgs:
        s, d, surl, durl = metrics_peers(imgs)
        try:
            for url in (surl, durl):
                status, text = get(url)
                check(status == 200, status)
                promtool_check(text)
                check(value(text, 'qmigd_migration_status{status="none"}') == 1, text)
            s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 32 * MiB})
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(d)}")
            wait_status(s, ("active",), 60)
            # 64 MiB at 32 MiB/s: some seconds of bytes moving to catch.
            scraped = {}

            def moving():
                scraped["text"] = get(surl)[1]
                return value(scraped["text"], "qmigd_migration_transferred_bytes_total") > 0
            wait_until("a scrape showing bytes sent", moving, seen=lambda: scraped["text"])
            text = scraped["text"]
            promtool_check(text)
            check(value(text, 'qmigd_migration_status{status="active"}') == 1, text)
            wait_status(s, ("completed",), 60)
            wait_status(d, ("completed",), 60)
            check(files_equal(imgs[0][1], imgs[0][2]), "images differ")
            for url, side in ((surl, s), (durl, d)):
                _, text = get(url)
                promtool_check(text)
                check(value(text, 'qmigd_last_migration_status{status="completed"}') == 1, text)
                check(value(text, "qmigd_last_migration_end_timestamp_seconds") > 1.7e9, text)
                check(value(text, "qmigd_last_migration_transferred_bytes_total") > SIZE / 4, text)
                check(value(text, "qmigd_process_threads") >= 2, text)
            _, text = get(surl)
            q = s.qmp.cmd("query-migrate")
            check(value(text, "qmigd_last_migration_downtime_seconds") == q["downtime"] / 1000, text)
            check(value(text, "qmigd_last_migration_normal_pages_total") == q["ram"]["normal"], text)
        finally:
            stop_all(s, d)


@test
def test_scrape_during_a_park():
    """/metrics scraped without a pause while a destination parks a VM: the
    load thread makes the parked blocks as the stream announces them, while
    the loop lists them for each scrape. The parked block is listed after;
    in the TSan build, d.stop() finds no race between the two in its log."""
    with images(SIZE, "mixed") as imgs:
        park_dir = f"/dev/shm/{unique_name('metrics-park')}"
        os.mkdir(park_dir)
        dp = free_port()
        url = f"http://127.0.0.1:{dp}/metrics"
        s = Peer("qemu", "source", [("mem", imgs[0][1], SIZE)], "mp-src")
        d = Peer("qmigd", "dest", [], "mp-dst",
                 ["--ram-dir", park_dir, "--metrics", f"127.0.0.1:{dp}"])
        done = threading.Event()
        scrapes = []

        def scrape():
            while not done.is_set():
                scrapes.append(get(url)[1])

        t = threading.Thread(target=scrape)
        t.start()
        try:
            si, di, _ = migrate(s, d, False, 1, "legacy", max_bandwidth=32 * MiB)
            check(si["status"] == "completed" and di["status"] == "completed", (si, di))
            done.set()
            t.join()
            check(len(scrapes) > 3, f"{len(scrapes)} scrapes")
            _, text = get(url)
            check('qmigd_page_path_info{block="mem"' in text, text)
        finally:
            done.set()
            t.join()
            try:
                stop_all(s, d)
            finally:
                shutil.rmtree(park_dir, ignore_errors=True)


@test
def test_real_prometheus_scrapes_a_migration():
    """Debian's Prometheus scrapes both daemons every second; its API shows
    the source active during the migration and both sides' last migration
    completed with its bytes."""
    if not shutil.which("prometheus"):
        skip("prometheus is not installed (scripts/install-deps.sh installs it)")
    work = tempfile.mkdtemp(prefix="qmigd-prom-")
    prom = None
    with images(SIZE, "mixed") as imgs:
        s, d, surl, durl = metrics_peers(imgs)
        try:
            targets = [u.split("/")[2] for u in (surl, durl)]
            with open(os.path.join(work, "prometheus.yml"), "w") as f:
                f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                        "scrape_configs:\n  - job_name: qmigd\n    static_configs:\n"
                        f"      - targets: {json.dumps(targets)}\n")
            port = free_port()
            api = f"http://127.0.0.1:{port}/api/v1"
            log = open(os.path.join(work, "prometheus.log"), "w")
            prom = subprocess.Popen(
                ["prometheus", f"--config.file={work}/prometheus.yml",
                 f"--storage.tsdb.path={work}/data", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT)

            def ready():
                check(prom.poll() is None, "prometheus ended: " + open(log.name).read()[-2000:])
                try:
                    return get(f"http://127.0.0.1:{port}/-/ready", 2)[0] == 200
                except OSError:
                    return False
            wait_until("prometheus to be ready", ready, every=0.3,
                       seen=lambda: open(log.name).read()[-2000:])

            def query(expr):
                url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
                return json.loads(get(url)[1])["data"]["result"]
            # Scraping both before the migration starts.
            wait_until("prometheus to scrape both daemons",
                       lambda: len(query('up{job="qmigd"} == 1')) == 2, every=0.3,
                       seen=lambda: query("up"))
            # Prometheus labels each series with its target (instance).
            src_i, dst_i = targets
            # Slow (1 MiB/s) until Prometheus has scraped the source active
            # and moving, whenever its scrapes come; then at full speed.
            s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 1 * MiB})
            s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(d)}")
            wait_until("prometheus to scrape the source active and sending",
                       lambda: query(f'qmigd_migration_throughput_bytes_per_second'
                                     f'{{instance="{src_i}"}} > 0 and on(instance) '
                                     f'qmigd_migration_status{{status="active",'
                                     f'instance="{src_i}"}} == 1'), every=0.3,
                       seen=lambda: query(f'qmigd_migration_status{{instance="{src_i}"}} == 1'))
            s.qmp.cmd("migrate-set-parameters", {"max-bandwidth": 0})
            wait_status(s, ("completed",), 60)
            wait_status(d, ("completed",), 60)
            done = f'qmigd_last_migration_status{{status="completed"}} == 1'
            wait_until("prometheus to scrape both sides completed",
                       lambda: len(query(done)) == 2, every=0.3, seen=lambda: query(done))
            active = query('max_over_time(qmigd_migration_status{status="active",'
                           f'instance="{src_i}"}}[2m])')
            check(active and float(active[0]["value"][1]) == 1, active)
            done = query('qmigd_last_migration_status{status="completed"} == 1')
            check(sorted(r["metric"]["instance"] for r in done) == sorted(targets), done)
            roles = query('qmigd_info')
            check({r["metric"]["instance"]: r["metric"]["role"] for r in roles}
                  == {src_i: "source", dst_i: "destination"}, roles)
            sent = query('qmigd_last_migration_transferred_bytes_total')
            check(len(sent) == 2 and all(float(r["value"][1]) > SIZE / 4 for r in sent), sent)
            rate = query('max_over_time(qmigd_migration_throughput_bytes_per_second'
                         f'{{instance="{src_i}"}}[2m])')
            check(rate and float(rate[0]["value"][1]) > 0, rate)
            print(f"  Prometheus saw the source active and both sides completed "
                  f"({float(sent[0]['value'][1]) / MiB:.0f} MiB)")
        finally:
            if prom:
                end_process(prom, 10)
            try:
                stop_all(s, d)
            finally:
                shutil.rmtree(work, True)


@test
def test_bad_metrics_addresses_refused():
    """A malformed or taken --metrics address stops the daemon at start,
    saying why."""
    with images(SIZE, "zero") as imgs:
        taken = free_port()
        import socket
        holder = socket.socket()
        holder.bind(("127.0.0.1", taken))
        holder.listen(1)
        try:
            for addr, want in (("nohost", "expected HOST:PORT"), ("127.0.0.1:99999", "port must"),
                               ("127.0.0.1:80abc", "port must"),
                               (f"127.0.0.1:{taken}", "cannot listen there")):
                qmp = f"/tmp/qmigd-metrics-bad-{os.getpid()}.qmp"
                r = subprocess.run([QMIGD, "source", "--qmp", qmp, "--ram",
                                    f"mem={imgs[0][1]},size={SIZE}", "--metrics", addr],
                                   capture_output=True, text=True, timeout=30)
                check(r.returncode == 1 and want in r.stderr, (addr, r.returncode, r.stderr))
        finally:
            holder.close()


@test
def test_idle_scrapers_leave_descriptors_for_the_monitor():
    """Under a hard RLIMIT_NOFILE of 256 (below the 512 connections the
    endpoint takes by default) a crowd of idle HTTP clients must not take
    every descriptor: the monitor still answers and migrate-incoming still
    listens, at once, not after the clients' deadline."""
    import resource
    import socket
    d = tempfile.mkdtemp(prefix="qmigd-metrics-fds-", dir="/dev/shm")
    port, qmp_path = free_port(), os.path.join(d, "d.qmp")

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    p = subprocess.Popen([QMIGD, "dest", "--qmp", qmp_path, "--ram",
                          f"mem={os.path.join(d, 'd.ram')},size=16M",
                          "--metrics", f"127.0.0.1:{port}"], preexec_fn=low_limit,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socks = []
    try:
        QMP(qmp_path, timeout=10, startup=30).close()
        for _ in range(300):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        # The daemon has taken (or cut) every one of them.
        wait_until("the daemon to accept every idle scraper", lambda: accept_queue(port) == 0)
        # A latency test: with no descriptor left the monitor could take its
        # client only once a scraper's 5 s deadline freed one.
        q = QMP(qmp_path, timeout=3, startup=3)
        check(q.cmd("query-status")["status"] == "inmigrate", "monitor")
        q.cmd("migrate-incoming", uri="tcp:127.0.0.1:0")
        check(q.cmd("query-migrate")["status"] == "setup", "migrate-incoming")
        q.close()
        print(f"  {len(socks)} idle scrapers; the daemon holds "
              f"{len(os.listdir(f'/proc/{p.pid}/fd'))} descriptors of 256")
    finally:
        for c in socks:
            c.close()
        p.terminate()
        p.wait(10)
        shutil.rmtree(d, ignore_errors=True)


@test
def test_scrape_cost():
    """What serving /metrics costs: scrapes a second one client gets, and a
    migration's time scraped every second against not scraped (printed)."""
    with images(256 * MiB, "mixed") as imgs:
        s, d, surl, durl = metrics_peers(imgs, 256 * MiB)
        try:
            # A cost test: one client's scrapes for 2 s. Beside a hog it still
            # makes hundreds a second; 20 is what the text cache allows a flood.
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < 2:
                get(surl)
                n += 1
            rate = n / (time.monotonic() - t0)
            check(rate > 20, f"{rate:.0f} scrapes/s")
            times = {}
            for scraped in (False, True, False, True):
                if scraped:
                    import threading
                    stop = threading.Event()

                    def scrape():
                        while not stop.wait(1.0):
                            get(surl)
                            get(durl)
                    th = threading.Thread(target=scrape, daemon=True)
                    th.start()
                t = time.monotonic()
                s.qmp.cmd("migrate", uri=f"tcp:127.0.0.1:{start_incoming(d)}")
                wait_status(s, ("completed",), 60)
                wait_status(d, ("completed",), 60)
                times.setdefault(scraped, []).append(time.monotonic() - t)
                if scraped:
                    stop.set()
                    th.join()
                s.qmp.cmd("cont")  # postmigrate -> running, for the next round
                d.stop()
                d = Peer("qmigd", "dest", [("mem", imgs[0][2], 256 * MiB)], "m-dst2",
                         ["--metrics", durl.split("/")[2]])
            print(f"  {rate:.0f} scrapes/s served to one client; a 256 MiB migration "
                  f"{min(times[False]):.2f} s unscraped, {min(times[True]):.2f} s scraped every 1 s")
        finally:
            stop_all(s, d)


if __name__ == "__main__":
    main()
