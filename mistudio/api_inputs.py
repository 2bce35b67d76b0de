"""Bounds shared by the API's input serializers.

Every number a client sends is bounded (``mistudio/tests/test_untrusted_input.py`` walks every
input serializer and fails on an unbounded one): a value past what the database or numpy can hold
must be a 400 naming the field, never an overflow deep in a query (a 500).
"""

# PostgreSQL's ``integer`` (Django's IntegerField / PositiveIntegerField): row counts, offsets.
DATABASE_INT_MAX = 2**31 - 1
# Token positions and other indexes into arrays on disk (int64, with room to add to them).
ARRAY_INDEX_MAX = 2**62
