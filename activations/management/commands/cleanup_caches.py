"""``manage.py cleanup_caches``: expire, evict (LRU over budget), remove orphans, fail broken rows."""

from django.core.management.base import BaseCommand

from activations.services import cache_cleanup


class Command(BaseCommand):
    help = "Apply ACTIVATION_CACHE_MAX_BYTES and the inactivity expiry; remove orphan files; verify."

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="only say what would be done")
        parser.add_argument("--verify", action="store_true", help="also check every file's checksum")

    def handle(self, *args, **options):
        report = cache_cleanup(dry_run=options["dry_run"], verify_checksums=options["verify"])
        prefix = "would remove" if options["dry_run"] else "removed"
        for bucket, ids in report.items():
            verb = "marked failed" if bucket == "failed" else f"{prefix} ({bucket})"
            for cache_id in ids:
                self.stdout.write(f"{verb}: {cache_id}")
        self.stdout.write(", ".join(f"{len(ids)} {bucket}" for bucket, ids in report.items()))
