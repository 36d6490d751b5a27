"""PostgreSQL: triggers that notify the API processes' read caches of changes to keys, jobs and metrics

Statement-level triggers ``pg_notify`` a channel at the commit of any transaction that inserts,
updates, deletes or truncates the tables that ``shared.store.cache`` caches reads of: ``api_keys``
on ``tunejob_keys`` (until now sent by the code that creates and revokes keys), ``jobs`` and
``job_metrics`` on ``tunejob_jobs``. PostgreSQL folds the same notification sent many times in one
transaction into one. Nothing on SQLite (its caches read ``PRAGMA data_version``).

Revision ID: 0011
Revises: 0010
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TRIGGERS = {"api_keys": "tunejob_keys", "jobs": "tunejob_jobs", "job_metrics": "tunejob_jobs"}


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("""
        CREATE FUNCTION tunejob_notify_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify(TG_ARGV[0], '');
            RETURN NULL;
        END $$""")
    for table, channel in TRIGGERS.items():
        op.execute(
            f"CREATE TRIGGER {table}_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION tunejob_notify_changed('{channel}')"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TRIGGERS:
        op.execute(f"DROP TRIGGER {table}_changed ON {table}")
    op.execute("DROP FUNCTION tunejob_notify_changed()")
