"""receipt turns: a content hash of each answered turn, for follow-ups that continue it

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06 01:35:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0004'
down_revision: Union[str, None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('receipt_turns',
    sa.Column('receipt_seq', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('turn_hash', sa.String(length=71), nullable=False),
    sa.PrimaryKeyConstraint('receipt_seq', name=op.f('pk_receipt_turns'))
    )
    with op.batch_alter_table('receipt_turns', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_receipt_turns_turn_hash'), ['turn_hash'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('receipt_turns', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_receipt_turns_turn_hash'))
    op.drop_table('receipt_turns')
