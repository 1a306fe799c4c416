"""boilerplate blocks learned from ingest batches

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 00:50:00.000000
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


revision: str = '0002'
down_revision: Union[str, None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('boilerplate_blocks',
    sa.Column('block_hash', sa.String(length=71), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('pages', sa.Integer(), nullable=False),
    sa.Column('batch_pages', sa.Integer(), nullable=False),
    sa.Column('revision', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.String(length=40), nullable=False),
    sa.PrimaryKeyConstraint('block_hash', name=op.f('pk_boilerplate_blocks'))
    )


def downgrade() -> None:
    op.drop_table('boilerplate_blocks')
