"""Signals of the saes app, for apps above it (saes may not import them).

``group_completed`` is sent, with ``group=``, once a group's members are completed and saved, on
commit: ``features`` answers it by analysing the members when the group asks for it
(``SaeGroup.analyze_members``)."""

from django.dispatch import Signal

group_completed = Signal()
