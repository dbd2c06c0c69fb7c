"""Value checks behind ``KVCRLinkerConfig``: one-line errors naming flag and field.

``config`` declares the fields and their rules; this module holds the checks those
rules call: integer ranges, host names, ``peer_endpoint_allowlist`` entries
(``host|cidr[:port|:lo-hi]``, also parsed here for the control guard and the hint
parser) and the CURVE key files, read the way pyzmq's ``load_certificate`` reads
them but with the stdlib only. Each failure is a ``KVCRConfigError`` whose single
line starts with ``--unified-cache-external-linker-config: field '<name>'`` and
says what to change. Like ``config``, it imports nothing heavy.
"""

from __future__ import annotations

import ipaddress
import os

from sglang.srt.mem_cache.storage.kvcr.config.errors import KVCRConfigError

FLAG = "--unified-cache-external-linker-config"

_SECRET_FIELD = "control_curve_secret_key_file"
_KEYS_FIELD = "control_curve_public_keys_dir"
_MAKE_KEYS = "make keys with zmq.auth.create_certificates(dir, name)"
_Z85 = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    ".-:+=^!/*?&<>()[]{}@%$#"
)


def config_error(name: str, problem: str) -> KVCRConfigError:
    """The one-line error for field ``name``: ``<flag>: field '<name>' <problem>``."""
    return KVCRConfigError(f"{FLAG}: field '{name}' {problem}")


def show_value(value: object) -> str:
    """A short one-line rendering of a bad value for an error message.

    ``repr`` of an int past Python's str-conversion digit limit (or a container
    holding one) raises ValueError, which must not escape the config parser.
    """
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def require_int(
    name: str, value: object, *, minimum: int, maximum: int | None = None
) -> None:
    """``value`` is an int (not a bool) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(name, f"must be an integer, got {show_value(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise config_error(name, f"must be {bound}, got {show_value(value)}")


def require_host(name: str, value: object) -> None:
    """A host name or address: a string without spaces or control characters."""
    if (
        not isinstance(value, str)
        or any(c.isspace() for c in value)
        or not value.isprintable()
    ):
        raise config_error(
            name,
            "must be a host name or IP address without spaces or control characters",
        )


def is_wildcard(host: str) -> bool:
    """An address that binds every interface (and that no peer can dial)."""
    return host in ("0.0.0.0", "::", "*")


def parse_allowlist_entry(entry: str) -> tuple[ipaddress._BaseNetwork | str, int, int]:
    """Parse ``host|cidr[:port|:lo-hi]`` into (network or host name, lo, hi)."""
    text = entry.strip()
    port_lo, port_hi = 0, 65535
    host = text
    if text.startswith("["):  # [v6]:port or [v6/len]:port
        host, bracket, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port_lo, port_hi = _parse_ports(entry, rest[1:])
        elif rest or not bracket:
            # Anything else after ']' (e.g. '[fd00::]/64:7000') would otherwise be
            # dropped silently, and with it the entry's port restriction.
            raise config_error(
                "peer_endpoint_allowlist",
                f"entry {entry!r} must be '[address or CIDR]' optionally followed "
                f"by ':port' or ':lo-hi', e.g. '[fd00::/64]:7000'",
            )
    elif text.count(":") == 1:
        host, _, ports = text.partition(":")
        port_lo, port_hi = _parse_ports(entry, ports)
    if not host:
        raise config_error("peer_endpoint_allowlist", f"entry {entry!r} has no host")
    try:
        return ipaddress.ip_network(host, strict=False), port_lo, port_hi
    except ValueError:
        if any(c.isspace() or c in "/[]" for c in host):
            raise config_error(
                "peer_endpoint_allowlist", f"entry {entry!r} is not a host or CIDR"
            ) from None
        return host.lower(), port_lo, port_hi


def _parse_ports(entry: str, text: str) -> tuple[int, int]:
    lo_text, _, hi_text = text.partition("-")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if hi_text else lo
    except ValueError:
        raise config_error(
            "peer_endpoint_allowlist", f"entry {entry!r} has a bad port range"
        ) from None
    if not 0 < lo <= hi <= 65535:
        raise config_error(
            "peer_endpoint_allowlist", f"entry {entry!r} ports must be in 1..65535"
        )
    return lo, hi


def check_curve_fields(secret: str, keys: str) -> None:
    """Both CURVE fields or neither; a readable secret key file; a key directory."""
    for name, value in ((_SECRET_FIELD, secret), (_KEYS_FIELD, keys)):
        if not isinstance(value, str) or not value.isprintable():
            raise config_error(name, "must be a path string")
    if not secret and not keys:
        return
    if not secret or not keys:
        missing = _SECRET_FIELD if not secret else _KEYS_FIELD
        present = _KEYS_FIELD if not secret else _SECRET_FIELD
        raise config_error(
            missing, f"is required when {present} is set; set both or neither"
        )
    if not os.path.isfile(secret) or not os.access(secret, os.R_OK):
        raise config_error(
            _SECRET_FIELD,
            f"{secret!r} is not a readable file; point it at this worker's "
            f"'.key_secret' file ({_MAKE_KEYS})",
        )
    _check_private(secret)
    found = _curve_keys(_SECRET_FIELD, secret)
    if not _is_z85_key(found.get("secret-key")) or not _is_z85_key(
        found.get("public-key")
    ):
        raise config_error(
            _SECRET_FIELD,
            f"{secret!r} holds no valid CURVE secret key (the '.key' file is "
            f"the public half); use the '.key_secret' file ({_MAKE_KEYS})",
        )
    if not os.path.isdir(keys) or not os.access(keys, os.R_OK | os.X_OK):
        raise config_error(
            _KEYS_FIELD,
            f"{keys!r} is not a readable directory; put the peers' '.key' public "
            f"key files in one ({_MAKE_KEYS})",
        )
    names = sorted(n for n in os.listdir(keys) if n.endswith(".key"))
    if not names:
        raise config_error(
            _KEYS_FIELD, f"{keys!r} holds no '.key' public key files; {_MAKE_KEYS}"
        )
    for name in names:
        path = os.path.join(keys, name)
        if not _is_z85_key(_curve_keys(_KEYS_FIELD, path).get("public-key")):
            raise config_error(
                _KEYS_FIELD, f"{path!r} holds no valid CURVE public key; {_MAKE_KEYS}"
            )


def _check_private(secret: str) -> None:
    """A secret key only this worker's user owns and can read: anyone else who
    can read it can pose as this worker to every peer that trusts its key."""
    st = os.stat(secret)
    if st.st_uid != os.geteuid():
        raise config_error(
            _SECRET_FIELD,
            f"{secret!r} is owned by uid {st.st_uid}, not this worker's user (uid "
            f"{os.geteuid()}); chown it to the user the server runs as",
        )
    if st.st_mode & 0o077:
        raise config_error(
            _SECRET_FIELD,
            f"{secret!r} is open to other users (mode {st.st_mode & 0o777:o}); "
            f"chmod 600 it",
        )


def _curve_keys(field: str, path: str) -> dict[str, str]:
    """The ``public-key``/``secret-key`` values of a ZeroMQ certificate file, read
    as pyzmq's ``load_certificate`` does (stdlib only: no pyzmq here)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 16).splitlines()
    except OSError as exc:
        raise config_error(field, f"{path!r} cannot be read ({exc.strerror})") from None
    found: dict[str, str] = {}
    for line in lines:
        name, eq, value = line.strip().partition("=")
        if eq and name.strip() in ("public-key", "secret-key"):
            found[name.strip()] = value.strip(" \t'\"")
    return found


def _is_z85_key(key: str | None) -> bool:
    """A 40-character Z85 text that decodes to a 32-byte CURVE key."""
    if not isinstance(key, str) or len(key) != 40 or any(c not in _Z85 for c in key):
        return False
    for i in range(0, 40, 5):
        value = 0
        for c in key[i : i + 5]:
            value = value * 85 + _Z85.index(c)
        if value >= 1 << 32:
            return False
    return True
