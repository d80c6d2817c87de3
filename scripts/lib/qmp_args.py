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
_BLANKS = " \t\n\v\f\r"  # C's isspace
_DIGITS = "0123456789"
_HEX = _DIGITS + "abcdefABCDEF"


def _digits(text, at, alphabet):
    end = at
    while end < len(text) and text[end] in alphabet:
        end += 1
    return end


def _strtosz(t, default_shift):
    """QEMU 10's do_strtosz (util/cutils.c), as monitor/qemu_size.cpp: the
    value, or None. ASCII digits only, as C's strtoull and strtod read."""
    i = _digits(t, 0, _BLANKS)
    sign = t[i:i + 1]
    j = i + (sign in ("+", "-") and sign != "")
    end = _digits(t, j, _DIGITS)
    have_int = end > j
    if have_int and sign == "-":
        return None
    val, valf = (int(t[j:end]) if have_int else 0), 0
    if val >= 1 << 64:
        return None
    if have_int and val == 0 and t[end:end + 1] in ("x", "X"):
        h = _digits(t, end + 1, _HEX)
        if h == end + 1:  # "0x" without a digit: strtoull reads the 0 alone
            return None
        val, end = int(t[end + 1:h], 16), h
        if val >= 1 << 64 or t[end:end + 1] == "." or (t[end:end + 1].upper() in _UNITS
                                                        and end < len(t)):
            return None
    elif t[end:end + 1] == "." or (not have_int and "." in t):
        if have_int and t[end] == "." and t[end + 1:end + 2] not in tuple(_DIGITS):
            end += 1
        else:
            # strtod on what follows, cut at the first e/E (the exa unit):
            # only [blanks][sign].digits can be a number there (digits
            # before the '.' went to the integral part).
            at = end if have_int else j
            k = _digits(t, at + 1, _DIGITS)
            if t[at:at + 1] != "." or k == at + 1 or (not have_int and sign == "-"):
                return None
            digits, end = t[at + 1:k], k
            fraction = float("0." + digits)
            if fraction == 1.0:
                val += 1
                if val >= 1 << 64:
                    return None
            else:
                valf = int(fraction * 2.0 ** 64)
                if valf == 0 and digits.strip("0"):
                    valf = 1  # below a double's least: still not 0
    elif not have_int:
        return None
    unit = t[end:end + 1].upper()
    if unit and unit in _UNITS:
        mul, end = 1 << (10 * _UNITS.index(unit)), end + 1
    else:
        mul = 1 << default_shift
    if end != len(t):
        return None
    if mul == 1:
        return None if valf else val
    # 64.64 fixed point times the unit, 0.5 rounded up; no more than 64 bits.
    total = val * mul + ((valf * mul) >> 64) + (((valf * mul) & ((1 << 64) - 1)) >> 63)
    return total if total < 1 << 64 else None


def parse_size(text, default_shift=0):
    """QEMU 10's size syntax (util/cutils.c qemu_strtosz; qemu_strtosz_MiB
    with default_shift 20): blanks and a '+', decimal with an optional
    fraction (rounded as QEMU does), or 0x hex without fraction or unit; an
    optional unit B K M G T P E (binary, any case). tests/data/qemu-sizes.json
    is QEMU 10's own answer for each of the cases. An int passes through.
    ValueError when it is not a size, in QEMU's words with the forms it takes."""
    if isinstance(text, int):
        return text
    value = _strtosz(text, default_shift)
    if value is None:
        raise ValueError(f"'{text}' expects a size value (bytes, or with a unit: "
                         "256M, 1.5G, 0x10000000)")
    return value
