"""Answering "what happened to this job?" from the data the job path wrote.

- ``explain``: one job's timeline and verdict (``manage.py explicit_explain``), from
  ``lookup`` (the jobs a key, an id or a business id names) and ``timeline`` (one line
  per row the job left).
- ``verdict``: the sentence a job's facts add up to, and its cause.
- ``window``: every job in a time window, grouped by verdict.
- ``metrics_view``: the Prometheus endpoint for the database-side series.
"""
