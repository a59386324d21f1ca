"""A node's key pair for SuperLink node authentication.

Flower's SuperLink, started with ``--enable-supernode-auth``, admits only SuperNodes whose
public key was registered with it; a SuperNode proves it holds the matching private key
(``--auth-supernode-private-key``). Flower reads both keys in OpenSSH format on a NIST
curve. ``fedkit deploy keygen`` makes such a pair, so a site needs no ``ssh-keygen``;
``fedkit deploy node --auth-key`` reads the private one.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec


def public_path(private: Path) -> Path:
    """Where the public key of ``private`` is written: beside it, with ``.pub`` added."""
    return private.with_name(private.name + ".pub")


def make_key_pair(private: Path) -> Path:
    """Write a new P-384 private key to ``private`` (readable by its owner only) and its
    public key beside it; return the public key's path. An existing file is never
    replaced: a node's registered key would stop matching."""
    public = public_path(private)
    for path in (private, public):
        if path.exists():
            raise FileExistsError(f"{path} exists; a node's key is not replaced")
    key = ec.generate_private_key(ec.SECP384R1())
    secret = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    opened = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(opened, "wb") as handle:
        handle.write(secret)
    shared = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    public.write_bytes(shared + b"\n")
    return public


def load_key_pair(private: Path) -> tuple[ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey]:
    """The key pair of the OpenSSH private key at ``private``; ``ValueError`` naming the
    file when it cannot be read or is not an elliptic-curve key."""
    try:
        key = serialization.load_ssh_private_key(private.read_bytes(), None)
    except OSError as error:
        raise ValueError(f"{private}: {error.strerror}") from None
    except (ValueError, UnsupportedAlgorithm) as error:
        raise ValueError(f"{private}: not an OpenSSH private key ({error})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{private}: expected an elliptic-curve key (fedkit deploy keygen)")
    return key, key.public_key()
