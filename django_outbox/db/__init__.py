"""The PostgreSQL side that is ours rather than Django's.

- ``libpq``: the fast path that sends ``BEGIN`` and ``COMMIT`` with a transaction's
  statements through libpq, the one module that knows libpq.
"""
