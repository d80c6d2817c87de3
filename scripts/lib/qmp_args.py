"""NAME=VALUE arguments of qmig's command line, as QMP arguments: VALUE is
JSON where it is JSON, else a string; dotted names build nested objects."""
import json


class UsageError(Exception):
    pass


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def parse_value(name, text):
    """JSON where the text is JSON; a plain word stays a string. Text that
    starts like JSON (a bracket, a brace, a quote) but is not is a mistake
    the daemon would only answer with an error, so it is one here."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except ValueError as e:
        if text[:1] in '[{"':
            raise UsageError(f"{name}={text}: not valid JSON ({e})") from None
        return text


def parse_args(pairs):
    args = {}
    for pair in pairs:
        if "=" not in pair:
            raise UsageError(f"expected NAME=VALUE, got {pair!r}")
        name, text = pair.split("=", 1)
        *path, leaf = name.split(".")
        if not leaf or not all(path):
            raise UsageError(f"{name!r}: empty name in a dotted path")
        node = args
        for i, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"{name!r} conflicts with {'.'.join(path[:i + 1])!r}")
        if leaf in node:
            raise UsageError(f"{name!r} is given twice, or also as the start of a dotted name")
        node[leaf] = parse_value(name, text)
    return args


_UNITS = "BKMGTPE"


def parse_size(text):
    """QEMU's size syntax (util/cutils.c, as monitor/qemu_size.h): decimal
    with an optional fraction, or 0x hex; then an optional unit B K M G T P E
    (binary, any case). An int passes through. ValueError when it is not a
    size, in QEMU's words with the forms it takes."""
    if isinstance(text, int):
        return text
    t = text.strip()
    unit = t[-1:].upper()
    shift = 10 * _UNITS.index(unit) if unit and unit in _UNITS else 0
    number = t[:-1] if shift or unit == "B" else t
    try:
        if number[:2].lower() == "0x":
            value = int(number[2:], 16) << shift
        elif "." in number:
            whole, frac = number.split(".", 1)
            if not shift or not whole.isdigit() or not (frac.isdigit() or frac == ""):
                raise ValueError
            value = (int(whole) << shift) + int(float("0." + (frac or "0")) * (1 << shift))
        elif number.isdigit():
            value = int(number) << shift
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"'{text}' expects a size value (bytes, or with a unit: "
                         "256M, 1.5G, 0x10000000)") from None
    if value >= 1 << 64:
        raise ValueError(f"'{text}' does not fit in 64 bits")
    return value
