"""CURVE key material: ZeroMQ's own authentication and encryption (CurveZMQ, ZeroMQ RFC 26).

The aggregator holds a server key pair; agents hold a client key pair (one per agent group, or one
shared by all) and the server's public key. The aggregator admits only the client public keys it
is given (ZAP, ZeroMQ RFC 27, through pyzmq's :class:`zmq.auth.thread.ThreadAuthenticator`); a
peer without keys, with another client key or with a wrong server key fails the handshake and
never gets a message in.

Keys are 32-byte Curve25519 keys written as 40-character Z85 strings (ZeroMQ RFC 32). Settings
take either such a string (typically from an environment variable) or a path to a certificate file
in zmq's format (``zmq.auth.create_certificates``: ``NAME.key`` holds the public key,
``NAME.key_secret`` the public and the secret key). :func:`make_keys` (``gradwatch keys DIR``)
writes::

    DIR/server.key            public  -> agents (GRADWATCH_SERVER_KEY)
    DIR/server.key_secret     secret  -> the aggregator only (--server-key)
    DIR/clients/NAME.key      public  -> the aggregator's allowed keys (--client-keys DIR/clients)
    DIR/NAME.key_secret       secret  -> the agents of NAME (GRADWATCH_CLIENT_KEY)

Secret files are written 0600. Imports neither torch nor the agent nor the aggregator.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq
import zmq.auth
from zmq.utils import z85

#: handshake failures of a CURVE server socket: each is one refused connection attempt
REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class KeyMaterialError(ValueError):
    """A key setting names no readable certificate and is no valid Z85 key; the message says which.
    Never contains a secret value."""


def _z85_key(value: str) -> Optional[bytes]:
    """The value as Z85 bytes if it is a 40-character Z85 encoding of 32 bytes, else None."""
    if len(value) != 40:
        return None
    try:
        raw = z85.decode(value.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        return None
    return value.encode("ascii") if len(raw) == 32 else None


def _describe(value: str, secret: bool) -> str:
    """How an error names a key setting's value: a public one as it is; a secret one only when it
    is a path (in a directory that exists, or a ``.key_secret`` file's name: "_" is no Z85
    character), else never, even in part (a key in quotes, cut, or pasted twice is still most of
    a secret): its length."""
    parent = os.path.dirname(value)  # ("/" itself is no sign: a key may start with "/")
    if not secret or (len(value) < 4096 and (value.endswith(".key_secret") or (parent.strip("/") and os.path.isdir(parent)))):
        return repr(value)
    return f"the value given ({len(value)} characters, not shown: it may be a secret)"


def _reachable(value: str, secret: bool = False) -> None:
    """Raises KeyMaterialError when ``value`` is a path this process may not look at (a directory
    on the way without search permission): else it read as "names no file"."""
    try:
        os.stat(value)
    except PermissionError:
        raise KeyMaterialError(f"{_describe(value, secret)}: permission denied to this process (uid {os.geteuid()}): make the "
                               "directories on the way searchable by it (gradwatch keys makes its directory 0711)") from None
    except (OSError, ValueError):  # no such file, a name too long (a pasted key): judged by the caller
        pass


def _certificate(value: str, secret: bool) -> tuple[bytes, Optional[bytes]]:
    path = Path(value)
    _reachable(value, secret)
    if not os.path.isfile(value):  # (Path.is_file raises on a name too long: a pasted certificate)
        what = "is not a file" if os.path.lexists(value) else "names no file"
        raise KeyMaterialError(f"{_describe(value, secret)} {what}, and is no 40-character Z85 key either")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyMaterialError(f"cannot read certificate {str(path)!r}: {e}") from None
    if _z85_key(public.decode("ascii", "replace")) is None:
        raise KeyMaterialError(f"certificate {str(path)!r}: public-key is not a 40-character Z85 key")
    if sec is not None:
        if _z85_key(sec.decode("ascii", "replace")) is None:
            raise KeyMaterialError(f"certificate {str(path)!r}: secret-key is not a 40-character Z85 key")
        if zmq.curve_public(sec) != public:
            raise KeyMaterialError(f"certificate {str(path)!r}: secret-key does not match its public-key")
    return public, sec


def load_public(value: str) -> bytes:
    """A public key (Z85 bytes, 40) from a certificate file (``.key`` or ``.key_secret``) or a
    Z85 string.

    Raises:
        KeyMaterialError: neither a readable certificate nor a Z85 key.
    """
    value = value.strip()  # a secret store's trailing newline
    key = _z85_key(value) if not os.path.isfile(value) else None
    return key if key is not None else _certificate(value, secret=False)[0]


def load_pair(value: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` (Z85 bytes, 40 each) from a ``.key_secret`` certificate file or a Z85
    secret key (the public key is derived from it, Curve25519 scalar multiplication).

    Raises:
        KeyMaterialError: not a certificate holding a secret key, nor a Z85 key.
    """
    value = value.strip()  # a secret store's trailing newline
    key = _z85_key(value) if not os.path.isfile(value) else None
    if key is not None:
        return zmq.curve_public(key), key
    public, sec = _certificate(value, secret=True)
    if sec is None:
        raise KeyMaterialError(f"{value!r} holds only a public key: give the .key_secret file")
    return public, sec


def load_allowed(value: str) -> frozenset[bytes]:
    """Client public keys (Z85 bytes) from a directory of ``.key`` files (as
    ``zmq.auth.load_certificates`` reads it), one certificate file, or one Z85 public key.

    Raises:
        KeyMaterialError: unreadable, no key found, or secret keys among them.
    """
    value = value.strip()  # a secret store's trailing newline
    _reachable(value)
    if os.path.isdir(value):
        try:
            keys = frozenset(zmq.auth.load_certificates(value))
        except (OSError, ValueError) as e:
            raise KeyMaterialError(f"cannot read the certificates in {value!r}: {e}") from None
        if not keys:
            raise KeyMaterialError(f"directory {value!r} holds no .key file")
        if any(name.endswith(".key_secret") for name in os.listdir(value)):
            # gradwatch keys' own directory: its server.key would be admitted as a client's
            raise KeyMaterialError(f"directory {value!r} holds secret keys: give the directory of the clients' "
                                   f"public keys only (gradwatch keys writes it as DIR/clients)")
        bad = [k for k in keys if _z85_key(k.decode("ascii", "replace")) is None]
        if bad:
            raise KeyMaterialError(f"directory {value!r}: a public-key is not a 40-character Z85 key")
        return keys
    if not os.path.isfile(value):
        return frozenset({load_public(value)})  # a Z85 key, else load_public's error
    public, sec = _certificate(value, secret=False)
    if sec is not None:  # as for a directory: a client's secret stays with it (server.key_secret
        # here would admit whoever holds the aggregator's own pair)
        raise KeyMaterialError(f"{value!r} holds a secret key: give the client's public .key file")
    return frozenset({public})


@dataclass(frozen=True)
class ClientKeys:
    """An agent's CURVE keys, Z85 bytes: the aggregator's public key and the agent's own pair."""

    server: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client; before ``connect``."""
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@dataclass(frozen=True)
class ServerKeys:
    """The aggregator's CURVE keys, Z85 bytes, and the client public keys it admits."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server; before ``bind``."""
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def authenticator(self, ctx: zmq.Context):
        """Start a ZAP handler thread in ``ctx`` that admits exactly :attr:`clients`; its User-Id
        for an admitted peer is the peer's Z85 public key (pyzmq's ``curve_user_id``), which the
        aggregator reads from each frame (``Frame.get("User-Id")``). Stop it before ``ctx.term()``.
        Without a handler libzmq would admit any client that knows the server key."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", _Allowed(self.clients))
        return auth


class _Allowed:
    """pyzmq's credentials-provider interface: ``callback(domain, z85_key) -> bool``."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


# --- gradwatch keys ------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def make_keys(directory, clients=("client",), force: bool = False) -> dict[str, Path]:
    """Write a server key pair and one client key pair per name into ``directory`` (layout in the
    module docstring). Secret files get mode 0600, public ones 0644; files appear complete or not
    at all (written in a private temporary folder, then renamed).

    Args:
        directory: created (0711: the public keys reachable by a service's user, the directory not
            listable) if missing.
        clients: client names; one name (the default) gives a pair shared by every agent.
        force: overwrite existing files.

    Returns:
        ``{"server.key", "server.key_secret", "clients/NAME.key", "NAME.key_secret": path}``.

    Raises:
        ValueError: an invalid or duplicate client name.
        FileExistsError: a file exists and ``force`` is false.
    """
    names = list(clients)
    for n in names:
        if not _NAME.fullmatch(n) or n == "server":
            raise ValueError(f"client name {n!r}: letters, digits, '_', '.', '-' (not 'server'), at most 64")
    if not names or len(set(names)) != len(names):
        raise ValueError(f"client names must be given and distinct, got {names}")
    root = Path(directory)
    # made 0711: a service user (systemd's DynamicUser, a pod's uid) reaches clients/ and the
    # public server.key but cannot list the directory; each secret file is 0600 itself
    for d, mode in ((root, 0o711), (root / "clients", 0o755)):
        if not d.exists():
            d.mkdir(parents=True)
            os.chmod(d, mode)  # whatever the umask
    # final name -> (key pair name, which file)
    plan = {"server.key": ("server", "key"), "server.key_secret": ("server", "key_secret")}
    for n in names:
        plan[f"clients/{n}.key"] = (n, "key")
        plan[f"{n}.key_secret"] = (n, "key_secret")
    existing = [p for p in plan if (root / p).exists()]
    if existing and not force:
        raise FileExistsError(f"{root / existing[0]} exists (use --force to replace the keys)")
    out = {}
    with tempfile.TemporaryDirectory(dir=root, prefix=".keys-") as tmp:  # mode 0700
        for pair in ("server", *names):
            zmq.auth.create_certificates(tmp, pair)
        for final, (pair, kind) in plan.items():
            src = Path(tmp) / f"{pair}.{kind}"
            os.chmod(src, 0o600 if kind == "key_secret" else 0o644)
            os.replace(src, root / final)
            out[final] = root / final
    return out
