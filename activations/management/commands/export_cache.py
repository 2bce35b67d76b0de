"""``manage.py export_cache CACHE OUT.tar``: the cache's files as a tar archive (safetensors inside)."""

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from activations.models import ActivationCache
from activations.selectors import cache_tar_stream


class Command(BaseCommand):
    help = "Write a completed activation cache to a tar archive."

    def add_arguments(self, parser):
        parser.add_argument("cache", help="cache id (act_…)")
        parser.add_argument("output", help="the .tar file to write")

    def handle(self, *args, **options):
        cache = ActivationCache.objects.filter(pk=options["cache"]).first()
        if cache is None or cache.status != ActivationCache.Status.COMPLETED:
            raise CommandError(f"No completed cache {options['cache']!r}.")
        output = Path(options["output"])
        written = 0
        with open(output, "wb") as handle:
            for chunk in cache_tar_stream(cache):
                handle.write(chunk)
                written += len(chunk)
        self.stdout.write(f"wrote {output} ({written:,} bytes)")
