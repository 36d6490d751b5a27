"""Secrets stored encrypted at rest: the webhook endpoints' signing secrets (``Sealed`` columns of
``shared.store.webhook_rows``), so that a copy of the job store (a backup, a dump, a stolen disk
image of the database server) does not let anyone sign deliveries that receivers trust.

Encryption is ``cryptography``'s Fernet (AES-128-CBC with HMAC-SHA256, an authenticated token) with
``MultiFernet`` for key rotation. The keys are ``TUNEJOB_SECRET_KEY``: one or more Fernet keys
(``Fernet.generate_key()``), comma-separated, the first encrypting and every one decrypting. Unset
on the embedded default (a SQLite store: one machine, one data directory), the key is
``<TUNEJOB_DATA_DIR>/secret_key``, made on first use with mode 0600. On PostgreSQL the processes
each have a data directory of their own (Docker Compose, Kubernetes), which a key made there would
not outlive, so ``TUNEJOB_SECRET_KEY`` must be set: without it storing or reading a secret is a
503 ``secret_key_missing``.

Rotating the key: put the new key first (``TUNEJOB_SECRET_KEY=new,old``), run
``tunejob db reseal`` (every secret encrypted again with the new key), then drop the old key.
"""

import os
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import Text
from sqlalchemy.types import TypeDecorator

from shared.errors import UserError
from shared.settings import get_settings

KEY_FILE = "secret_key"


def _key_file() -> bytes:
    """The data directory's key, made on first use: written under a temporary name with mode 0600
    and linked into place, so that processes starting at once all read the one that won."""
    path = get_settings().path(KEY_FILE)
    if not path.exists():
        made = path.with_name(f".{KEY_FILE}.{os.getpid()}")
        fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(Fernet.generate_key())
        try:
            os.link(made, path)
        except FileExistsError:
            pass
        finally:
            made.unlink()
    return path.read_bytes().strip()


@lru_cache
def _fernet(keys: str | None, data_dir: str) -> MultiFernet:
    try:
        return MultiFernet([Fernet(k.strip()) for k in keys.split(",") if k.strip()] if keys else [Fernet(_key_file())])
    except ValueError as e:
        raise ValueError(f"TUNEJOB_SECRET_KEY: not a comma-separated list of Fernet keys ({e})") from None


def fernet() -> MultiFernet:
    """This process's keys (``TUNEJOB_SECRET_KEY``, else on SQLite the data directory's key file).

    Raises:
        ValueError: ``TUNEJOB_SECRET_KEY`` holds something that is not a Fernet key.
        UserError: 503 ``secret_key_missing``: no ``TUNEJOB_SECRET_KEY`` on a PostgreSQL store.
    """
    settings = get_settings()
    if not settings.secret_key and not settings.sqlalchemy_url.startswith("sqlite"):
        raise UserError(
            "secret_key_missing",
            "webhook secrets are stored encrypted, and on a PostgreSQL job store "
            "the key must be set: TUNEJOB_SECRET_KEY (python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())'), the same for every API process",
            "TUNEJOB_SECRET_KEY",
            status=503,
        )
    return _fernet(settings.secret_key, str(settings.data_path))


def seal(plain: str) -> str:
    """``plain`` encrypted with the first key: a Fernet token (URL-safe base64 text)."""
    return fernet().encrypt(plain.encode()).decode()


def unseal(token: str) -> str:
    """The text ``seal`` encrypted into ``token``, with whichever key made it.

    Raises:
        ValueError: no key decrypts it (``TUNEJOB_SECRET_KEY`` lost or changed without keeping the old key).
    """
    try:
        return fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        raise ValueError(
            "a stored secret cannot be decrypted with TUNEJOB_SECRET_KEY (or the data directory's "
            "secret_key): was the key changed without keeping the old one after it?"
        ) from None


class Sealed(TypeDecorator):
    """A text column whose values are stored sealed (``seal``) and read back in the clear."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return None if value is None else seal(value)

    def process_result_value(self, value, dialect):
        return None if value is None else unseal(value)
