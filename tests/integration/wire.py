"""Builds QEMU migration-stream bytes for tests, independently of
protocol/ (from docs/wire-format.md), so the daemon can be
fed streams that are broken in precise ways."""
import json
import struct

PAGE = 4096
ZERO, MEM_SIZE, PAGE_F, EOS, CONTINUE, FLUSH = 0x2, 0x4, 0x8, 0x10, 0x20, 0x200
MULTIFD_SYNC = 0x1  # a multifd packet's flag


def be32(v):
    return struct.pack(">I", v)


def be64(v):
    return struct.pack(">Q", v)


def _bytes(s):
    return s if isinstance(s, bytes) else s.encode()


def cstr8(s):
    b = _bytes(s)
    return bytes([len(b)]) + b


def header(magic=0x5145564D, version=3):
    return be32(magic) + be32(version)


def config(machine="none"):
    m = _bytes(machine)
    return b"\x07" + be32(len(m)) + m


def command(cmd, payload=b""):
    return b"\x08" + struct.pack(">HH", cmd, len(payload)) + payload


OPEN_RETURN_PATH, PING, POSTCOPY_ADVISE, POSTCOPY_LISTEN, POSTCOPY_RUN, PACKAGED = 1, 2, 3, 4, 5, 7


DEVICES = (("dev0", 0, b"\x01\x02\x03\x04"),)


def device_sections(devices=DEVICES, first_id=10):
    """FULL device sections with their footers, and their descriptions as
    QEMU's VM description gives them (one field per body)."""
    out, desc = b"", []
    for i, (name, instance, body) in enumerate(devices):
        sid = first_id + i
        out += b"\x04" + be32(sid) + cstr8(name) + be32(instance) + be32(1) + body + footer(sid)
        desc.append({"name": name, "instance_id": instance, "vmsd_name": name, "version": 1,
                     "fields": [{"name": "data", "type": "buffer", "size": len(body)}]})
    return out, desc


def device_state(devices=DEVICES, first_id=10):
    """What follows RAM in a precopy stream: the device sections,
    QEMU_VM_EOF and a VM description that describes them."""
    out, desc = device_sections(devices, first_id)
    vmdesc = json.dumps({"page_size": PAGE, "devices": desc}).encode()
    return out + b"\x00\x06" + be32(len(vmdesc)) + vmdesc


def start(idstr="ram", sid=1, version=4):
    return b"\x01" + be32(sid) + cstr8(idstr) + be32(0) + be32(version)


def part(sid=1):
    return b"\x02" + be32(sid)


def end(sid=1):
    return b"\x03" + be32(sid)


def footer(sid=1):
    return b"\x7e" + be32(sid)


def mem_size(blocks):
    total = sum(size for _, size in blocks)
    out = be64(total | MEM_SIZE)
    for name, size in blocks:
        out += cstr8(name) + be64(size)
    return out


def page(offset, data, block="mem"):
    return be64(offset | PAGE_F) + (cstr8(block) if block else b"") + data


def flag(f):
    return be64(f)


def multifd_init(chan_id, uuid=bytes(16)):
    return be32(0x11223344) + be32(1) + uuid + bytes([chan_id]) + bytes(7) + bytes(32)


def multifd_packet(offsets, normal, zero=0, flags=0, block="mem", pages_alloc=128, num=0,
                   next_size=None):
    h = be32(0x11223344) + be32(1) + be32(flags) + be32(pages_alloc) + be32(normal)
    h += be32(normal * PAGE if next_size is None else next_size) + be64(num) + be32(zero)
    h += bytes(4 + 24)
    h += block.encode().ljust(256, b"\0")
    offs = b"".join(be64(o) for o in offsets)
    h += offs.ljust(128 * 8, b"\0")
    assert len(h) == 1344
    return h


def good_start(size, block="mem"):
    """The header, configuration and a RAM setup section: what every stream
    opens with, up to where pages may come."""
    return header() + config() + start() + mem_size([(block, size)]) + flag(EOS) + footer()


def good_plain_stream(size, fill=b"\x5a"):
    """A complete plain-precopy stream writing page 0 and zeroing page 1."""
    s = good_start(size)
    s += part() + page(0, fill * PAGE) + be64(PAGE | ZERO | CONTINUE) + b"\0" + flag(EOS) + footer()
    s += end() + flag(EOS) + footer() + b"\x00"
    return s


# Commands (QEMU_VM_COMMAND) and the return path's messages.
CMD_OPEN_RETURN_PATH, CMD_PING, CMD_POSTCOPY_ADVISE = 1, 2, 3
CMD_POSTCOPY_LISTEN, CMD_POSTCOPY_RUN, CMD_PACKAGED, CMD_RECV_BITMAP = 4, 5, 7, 10
RP_SHUT, RP_PONG, RP_RECV_BITMAP, RP_RESUME_ACK = 1, 2, 5, 6


def command(cmd, payload=b""):
    return b"\x08" + struct.pack(">HH", cmd, len(payload)) + payload


def rp_message(type_, payload):
    return struct.pack(">HH", type_, len(payload)) + payload


def postcopy_start(size, block="mem"):
    """A stream up to a postcopy destination running the guest: the return
    path opened, ADVISE (4 KiB pages), the RAM setup section, and the
    package with LISTEN and RUN. Pages may follow in PART sections or on
    the preempt channel."""
    s = header() + config() + command(CMD_OPEN_RETURN_PATH)
    s += command(CMD_POSTCOPY_ADVISE, be64(PAGE) + be64(PAGE))
    s += start() + mem_size([(block, size)]) + flag(EOS) + footer()
    package = command(CMD_POSTCOPY_LISTEN) + command(CMD_POSTCOPY_RUN)
    return s + command(CMD_PACKAGED, be32(len(package))) + package
