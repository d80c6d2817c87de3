#!/usr/bin/env python3
"""An exec: command for the TLS tests: joins its stdin and stdout to one
TCP connection, both ways, as `nc` would (not installed here).

  stdio_tcp.py connect PORT        connects to 127.0.0.1:PORT
  stdio_tcp.py listen PORT_FILE    listens on a free port, writes its number
                                   to PORT_FILE, takes one connection

stdin's end shuts the socket's write side; the socket's end closes stdout
and ends the command."""
import os
import socket
import sys
import threading


def pump_in(sock):
    while True:
        data = os.read(0, 1 << 16)
        if not data:
            break
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)


def main():
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "connect":
        sock = socket.create_connection(("127.0.0.1", int(arg)))
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        with open(arg + ".tmp", "w") as f:
            f.write(str(listener.getsockname()[1]))
        os.replace(arg + ".tmp", arg)
        sock, _ = listener.accept()
        listener.close()
    threading.Thread(target=pump_in, args=(sock,), daemon=True).start()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            break
        view = memoryview(data)
        while view:
            view = view[os.write(1, view):]
    os.close(1)


if __name__ == "__main__":
    main()
