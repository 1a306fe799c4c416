import hashlib
import hmac
import secrets
import subprocess
import sys

import pytest
from sqlalchemy import select

from app.auth import authenticate, create_key, key_table, list_keys, require, revoke_key
from app.models import ApiKey
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import Forbidden, InvalidInput, NotFound, Unauthenticated


def test_key_is_stored_only_as_salted_hash(engine):
    principal, key = create_key(engine, "operator", "ops")
    secret = key.split("_", 2)[2]
    with read_session(engine) as s:
        row = s.scalars(select(ApiKey)).one()
    assert secret not in (row.key_hash, row.salt, row.id, row.name)
    assert key not in str(list_keys(engine))
    assert authenticate(engine, key) == principal


def test_two_keys_with_the_same_secret_shape_get_different_salts(engine):
    create_key(engine, "copilot")
    create_key(engine, "copilot")
    with read_session(engine) as s:
        salts = [r.salt for r in s.scalars(select(ApiKey))]
    assert len(set(salts)) == 2


@pytest.mark.parametrize("presented", [None, "", "nonsense", "rb_deadbeef_secret"])
def test_missing_malformed_or_unknown_key_is_unauthenticated(engine, presented):
    with pytest.raises(Unauthenticated):
        authenticate(engine, presented)


def test_wrong_secret_for_a_known_id_is_unauthenticated(engine):
    principal, _ = create_key(engine, "admin")
    with pytest.raises(Unauthenticated):
        authenticate(engine, f"rb_{principal.id}_wrong")


def test_revoked_key_no_longer_authenticates(engine):
    principal, key = create_key(engine, "admin")
    revoke_key(engine, principal.id)
    with pytest.raises(Unauthenticated):
        authenticate(engine, key)
    with pytest.raises(NotFound):
        revoke_key(engine, "nope")


def test_roles_are_ordered_copilot_operator_admin(engine):
    cop, _ = create_key(engine, "copilot")
    op, _ = create_key(engine, "operator")
    require(op, "copilot")
    require(op, "operator")
    with pytest.raises(Forbidden):
        require(op, "admin")
    with pytest.raises(Forbidden):
        require(cop, "operator")
    with pytest.raises(InvalidInput):
        create_key(engine, "root")


def test_new_keys_are_checked_without_scrypt(engine, monkeypatch):
    principal, key = create_key(engine, "copilot")

    def no_scrypt(*_a, **_k):
        raise AssertionError("scrypt must not run for a current key")

    monkeypatch.setattr("app.auth.hashlib.scrypt", no_scrypt)
    assert authenticate(engine, key) == principal
    with pytest.raises(Unauthenticated):
        authenticate(engine, f"rb_{principal.id}_{'x' * 43}")


def test_unknown_id_is_compared_like_a_known_one_and_refused_with_the_same_message(engine, monkeypatch):
    principal, _ = create_key(engine, "copilot")
    compared: list[tuple[str, str]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("app.auth.hmac.compare_digest", spy)
    messages = []
    for presented in (f"rb_{principal.id}_{'x' * 43}", f"rb_{'0' * 16}_{'x' * 43}"):
        with pytest.raises(Unauthenticated) as exc:
            authenticate(engine, presented)
        messages.append(exc.value.message)
    assert len(compared) == 2  # one constant-time compare on both paths
    assert len(compared[0][0]) == len(compared[1][0])  # of digests of the same shape
    assert messages[0] == messages[1]


def test_revoked_key_is_refused_like_an_unknown_one(engine):
    principal, key = create_key(engine, "admin")
    revoke_key(engine, principal.id)
    with pytest.raises(Unauthenticated) as revoked:
        authenticate(engine, key)
    with pytest.raises(Unauthenticated) as unknown:
        authenticate(engine, f"rb_{'0' * 16}_{'x' * 43}")
    assert revoked.value.message == unknown.value.message


def test_legacy_scrypt_key_keeps_working_and_is_rehashed_on_first_use(engine):
    key_id, secret, salt = secrets.token_hex(8), secrets.token_urlsafe(32), secrets.token_hex(16)
    legacy = hashlib.scrypt(secret.encode(), salt=bytes.fromhex(salt), n=2**14, r=8, p=1,
                            dklen=32).hex()
    with write_transaction(engine, WriterLock.KEYS) as s:
        s.add(ApiKey(id=key_id, name="old", role="operator", salt=salt, key_hash=legacy,
                     created_at="2026-01-01T00:00:00.000000Z"))
    key = f"rb_{key_id}_{secret}"
    assert authenticate(engine, key).role == "operator"
    with read_session(engine) as s:
        row = s.get(ApiKey, key_id)
    assert row is not None and row.key_hash.startswith("hmac-sha256:") and secret not in row.key_hash
    assert authenticate(engine, key).role == "operator"  # and still works, now the fast way
    with pytest.raises(Unauthenticated):
        authenticate(engine, f"rb_{key_id}_{'y' * 43}")


def test_legacy_key_with_a_wrong_secret_is_refused_and_not_rehashed(engine):
    key_id, salt = secrets.token_hex(8), secrets.token_hex(16)
    legacy = hashlib.scrypt(b"right", salt=bytes.fromhex(salt), n=2**14, r=8, p=1, dklen=32).hex()
    with write_transaction(engine, WriterLock.KEYS) as s:
        s.add(ApiKey(id=key_id, name="old", role="admin", salt=salt, key_hash=legacy,
                     created_at="2026-01-01T00:00:00.000000Z"))
    with pytest.raises(Unauthenticated):
        authenticate(engine, f"rb_{key_id}_wrong")
    with read_session(engine) as s:
        assert s.get(ApiKey, key_id).key_hash == legacy


@pytest.mark.parametrize("presented", ["rb_NOTHEX0000000000_secret", "rb_0123_secret",
                                       "rb_0123456789abcdef_" + "s" * 129])
def test_key_with_a_bad_id_or_an_overlong_secret_is_malformed(engine, presented):
    with pytest.raises(Unauthenticated) as exc:
        authenticate(engine, presented)
    assert exc.value.message == "malformed API key"


def test_sqlite_key_checks_read_the_key_table_again_only_after_a_commit(engine, monkeypatch):
    """On a SQLite file a key check is a pragma and a dict lookup: the table is read once, and
    again only after some connection committed; a revocation made by another process is
    refused on the very next request. On PostgreSQL the row is read per request."""
    table = key_table(engine)
    if engine.dialect.name != "sqlite":
        assert table is None
        return
    assert table is not None
    principal, key = create_key(engine, "copilot")
    assert authenticate(engine, key) == principal
    reads = table.reads

    def no_pool(*args, **kwargs):
        raise AssertionError("a key check read the database through the pool")

    monkeypatch.setattr(engine, "connect", no_pool)
    for _ in range(5):
        assert authenticate(engine, key) == principal
    assert table.reads == reads  # nothing was committed: the table was not read again
    # Another process revokes the key: refused at once, after one read of the table.
    subprocess.run([sys.executable, "-c", (
        "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
        "c.execute('UPDATE api_keys SET revoked_at = ? WHERE id = ?', ('2026-01-01', sys.argv[2])); "
        "c.commit()"), engine.url.database, principal.id], check=True)
    with pytest.raises(Unauthenticated):
        authenticate(engine, key)
    assert table.reads == reads + 1
