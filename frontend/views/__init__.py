"""Server-rendered pages: plain function views over the same selectors the API uses.

Pages render the current state; their scripts act through the REST API (one path per operation)
and follow live events over ``/ws/events/``. One module per page family.
"""
