"""Alembic environment for the catalog.

`Catalog.open` runs migrations programmatically and hands us its own connection (already inside
a locked transaction, see db.migrate); the `alembic` command line, used by developers to write
new migrations, instead gets a URL from `-x url=...` or alembic.ini.
"""

from alembic import context
from sqlalchemy import create_engine

from mint_server.catalog.db import VERSION_TABLE
from mint_server.catalog.schema import Base

config = context.config


def _run(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things in place; batch mode rebuilds tables when needed.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("pass the database with: alembic -x url=sqlite:///path/catalog.db ...")
    with create_engine(url).begin() as conn:
        _run(conn)
