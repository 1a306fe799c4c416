import pytest
from sqlalchemy import select

from app.auth import authenticate, create_key, list_keys, require, revoke_key
from app.models import ApiKey
from foundation.db import read_session
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
