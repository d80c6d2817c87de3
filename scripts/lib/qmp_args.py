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
