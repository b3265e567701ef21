"""The PostgreSQL side that is ours rather than Django's: every statement we write by
hand, named and headed by its contract, and the one module that knows libpq.

- ``ledger_sql``: the effect's transaction: the ledger's claim, read and result, the
  fence read before commit and the takeover's fence write
- ``attempts_sql``: an attempt's row, written or replaced
- ``outbox_sql``: the outbox writer's row, its ordering lock and NOTIFY; the relays'
  LISTEN
- ``relay_sql``: the relay's claim (one per database) and the marks that end a batch
- ``libpq``: the fast path that sends ``BEGIN`` and ``COMMIT`` with a transaction's
  statements through libpq, the one module that knows libpq

Each statement is a constant headed the way ``celery_explicit.redis_scripts`` heads
its Lua: what it does, its parameters, what it returns, the locks it takes, and why it
is written so. The statements name their tables as literals and import no model;
``tests/unit/test_db_statements.py`` checks them against the models.
"""
