"""The job's credential: what a parameter-server connection proves at the ZeroMQ handshake.

A credential is one secret per job, ``"gcps-plain-<64 hex>"`` or
``"gcps-curve-<64 hex>"``: the mechanism (RFC 23 PLAIN or RFC 26 CURVE) and
32 random bytes. Everything a connection presents is derived from it with
HMAC-SHA256 (RFC 2104) and bound to one worker rank: the PLAIN password of
rank ``r`` (user ``w<r>``), the CURVE key pair of rank ``r`` and the CURVE key
pair of server ``s``. Whoever holds the credential can act as any worker rank
of the job (the trust boundary is the job); a process without it cannot
complete a handshake. PLAIN sends a rank's password in clear and nothing is
encrypted; CURVE (``encrypt=True``) authenticates both ends and encrypts every
message (CurveZMQ). See ``docs/parameter-server.md#who-may-connect``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["Credential", "Verifier", "new_credential", "credential_from", "agree_credential", "worker_user",
           "handshake_failures", "describe_handshake_failure", "CREDENTIAL_ENV", "MECHANISMS"]

#: environment variable a worker outside the process group reads its credential from
CREDENTIAL_ENV = "GRADCOMP_PS_CREDENTIAL"
#: mechanism of a credential -> PSConfig(encrypt=...)
MECHANISMS = {"plain": False, "curve": True}
_PREFIX = "gcps"


def worker_user(rank: int) -> bytes:
    """The user id (ZAP ``User-Id``) of worker rank ``rank``: ``b"w<rank>"``."""
    return b"w%d" % rank


def new_credential(encrypt: bool = False) -> str:
    """A fresh credential: PLAIN (``encrypt=False``) or CURVE, from 32 bytes of ``secrets``."""
    if not isinstance(encrypt, bool):
        raise TypeError(f"encrypt must be a bool, got {type(encrypt).__name__}")
    return f"{_PREFIX}-{'curve' if encrypt else 'plain'}-{secrets.token_hex(32)}"


@dataclass(frozen=True)
class Credential:
    """A parsed credential (its text is never shown by ``repr``).

    Args:
        text: ``"gcps-plain-<64 hex digits>"`` or ``"gcps-curve-<64 hex digits>"``.

    Raises:
        TypeError / ValueError: not a string of that form (the message names
            ``argname``, never the secret).
    """

    text: str = field(repr=False)
    argname: str = field(default="credential", repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise TypeError(f"{self.argname} must be a string made by gradcomp.ps.new_credential(), "
                            f"got {type(self.text).__name__}")
        parts = self.text.split("-")
        ok = (len(parts) == 3 and parts[0] == _PREFIX and parts[1] in MECHANISMS and len(parts[2]) == 64
              and all(c in "0123456789abcdef" for c in parts[2]))
        if not ok:
            raise ValueError(f"{self.argname} must be 'gcps-plain-<64 hex digits>' or "
                             "'gcps-curve-<64 hex digits>' (gradcomp.ps.new_credential(), or a "
                             "server's .credential)")

    @property
    def mechanism(self) -> str:
        """``"plain"`` or ``"curve"``."""
        return self.text.split("-")[1]

    @property
    def encrypt(self) -> bool:
        """CURVE: every message is encrypted."""
        return MECHANISMS[self.mechanism]

    def _derive(self, label: str) -> bytes:
        secret = bytes.fromhex(self.text.split("-")[2])
        return hmac.new(secret, f"gradcomp-ps/{self.mechanism}/{label}".encode(), hashlib.sha256).digest()

    def plain_password(self, rank: int) -> bytes:
        """The PLAIN password of worker rank ``rank`` (64 ASCII hex digits)."""
        return self._derive(f"w{rank}").hex().encode()

    def curve_keys(self, label: str) -> tuple[bytes, bytes]:
        """``(public, secret)`` Z85 CURVE keys of ``"w<rank>"`` or ``"server<index>"``."""
        import zmq
        from zmq.utils import z85

        secret = z85.encode(self._derive(label))  # any 32 bytes are a Curve25519 secret key
        return zmq.curve_public(secret), secret

    def server_options(self, server_index: int) -> dict[int, object]:
        """Socket options of server ``server_index``'s ROUTER sockets (set before binding)."""
        import zmq

        if not self.encrypt:
            return {zmq.PLAIN_SERVER: 1}
        public, secret = self.curve_keys(f"server{server_index}")
        return {zmq.CURVE_SERVER: 1, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}

    def client_options(self, rank: int, server_index: int) -> dict[int, object]:
        """Socket options of worker rank ``rank``'s DEALERs towards server ``server_index``."""
        import zmq

        if not self.encrypt:
            return {zmq.PLAIN_USERNAME: worker_user(rank), zmq.PLAIN_PASSWORD: self.plain_password(rank)}
        public, secret = self.curve_keys(f"w{rank}")
        return {zmq.CURVE_SERVERKEY: self.curve_keys(f"server{server_index}")[0],
                zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}

    def verifier(self, ranks) -> "Verifier":
        """The check of a ZAP request's credentials against worker ``ranks``."""
        return Verifier(self, ranks)


class Verifier:
    """Decides whether a handshake's credentials prove one worker rank of the job.

    Args:
        credential: the job's :class:`Credential`.
        ranks: the worker ranks (global) that may connect.
    """

    def __init__(self, credential: Credential, ranks):
        self.mechanism = credential.mechanism.upper()
        ranks = list(ranks)
        # every rank's expected proof, derived once (a CURVE public key costs a scalar multiplication)
        if credential.encrypt:
            self._keys = {credential.curve_keys(f"w{r}")[0]: worker_user(r) for r in ranks}
        else:
            self._passwords = {worker_user(r): credential.plain_password(r) for r in ranks}

    def check(self, mechanism: bytes, credentials: list[bytes]) -> tuple[bytes | None, str]:
        """``(user id, "")`` when ``credentials`` prove a worker rank, else ``(None, reason)``."""
        if mechanism.decode("ascii", "replace") != self.mechanism:
            return None, f"mechanism {mechanism.decode('ascii', 'replace')}, this job uses {self.mechanism}"
        if self.mechanism == "CURVE":
            from zmq.utils import z85

            ok = len(credentials) == 1 and len(credentials[0]) == 32
            user = self._keys.get(z85.encode(credentials[0])) if ok else None
            return (user, "") if user is not None else (None, "unknown CURVE key")
        if len(credentials) != 2:
            return None, "malformed PLAIN credentials"
        user, password = credentials
        expected = self._passwords.get(user)
        if expected is None:
            return None, "user is not a worker rank of this job"
        if not hmac.compare_digest(password, expected):
            return None, "wrong password"
        return user, ""


def credential_from(given, argname: str = "credential") -> Credential:
    """A :class:`Credential` from ``given``, or from ``$GRADCOMP_PS_CREDENTIAL`` when None.

    Raises:
        ValueError: neither is set, or the text is malformed.
    """
    if given is None:
        given = os.environ.get(CREDENTIAL_ENV)
        argname = f"${CREDENTIAL_ENV}"
        if not given:
            raise ValueError("a worker outside the process group needs the job's credential: pass "
                             f"credential= (a server's .credential) or set ${CREDENTIAL_ENV}")
    return Credential(given, argname)


def agree_credential(group, num_servers: int, own: Credential | None, encrypt: bool | None) -> Credential:
    """Every rank of ``group`` calls this once (a collective), before the
    servers bind: servers with their given credential (or None) and their
    ``encrypt`` setting, workers with ``(None, None)``. Server 0 creates the
    credential when no server was given one.

    Returns:
        The job's credential (the same on every rank).

    Raises:
        ValueError: the servers were given different credentials, or
            different ``encrypt`` settings, or a credential whose mechanism
            contradicts ``encrypt`` (on every rank, naming no secret).
    """
    rank = dist.get_rank(group)
    fresh = new_credential(bool(encrypt)) if rank == 0 else None
    mine = (None if own is None else own.text, encrypt, fresh)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    servers = out[:num_servers]
    settings = sorted({bool(e) for _, e, _ in servers})
    if len(settings) > 1:
        raise ValueError("the parameter servers were given different encrypt settings: give every "
                         "server the same PSConfig(encrypt=...)")
    given = {text for text, _, _ in servers if text is not None}
    if len(given) > 1:
        raise ValueError("the parameter servers were given different credentials: give every server "
                         "the same credential (or none: the job then creates one)")
    credential = Credential(given.pop() if given else servers[0][2])
    if credential.encrypt != settings[0]:
        raise ValueError(f"the servers' credential is for {credential.mechanism.upper()} "
                         f"but encrypt={settings[0]}: make one new_credential(encrypt={settings[0]})")
    return credential


def handshake_failures() -> int:
    """The socket-monitor events of a failed handshake (``zmq.EVENT_HANDSHAKE_FAILED_*``)."""
    import zmq

    return (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def describe_handshake_failure(event: dict, credential: Credential) -> str | None:
    """What a worker's failed handshake means, from its socket monitor's
    ``event`` (``zmq.utils.monitor.recv_monitor_message``); None for other events."""
    import zmq

    kind, value = event["event"], event["value"]
    mine = credential.mechanism.upper()
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the server refused this process's credential at the handshake (ZAP status {int(value)}): "
                "it is not the job's credential for this rank (use the servers' .credential)")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (f"the server uses another security mechanism than this credential's {mine} "
                    "(encrypt=True servers take a 'gcps-curve-' credential, the others 'gcps-plain-')")
        return (f"the {mine} handshake with the server failed (ZMTP protocol error {int(value):#x}): "
                "a credential of another job, or not a gradcomp parameter server at that address")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return (f"the server closed the connection during the {mine} handshake (errno {int(value)}): it uses "
                "another security mechanism (encrypt=True servers take a 'gcps-curve-' credential, the "
                "others 'gcps-plain-'), or is not a gradcomp parameter server")
    return None
