"""``manage.py create_user NAME --role model:write``: a user with a role, and its API token."""

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand
from django.db import transaction

from mistudio.api_tokens import api_token_create
from mistudio.roles import ROLES


class Command(BaseCommand):
    help = "Create (or update) a user with a role and print its API token."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--role", choices=ROLES, default="model:read")
        parser.add_argument("--password", help="Also set a password for signing in to the pages.")
        parser.add_argument("--superuser", action="store_true", help="Also give Django admin access.")

    @transaction.atomic
    def handle(self, *args, **options):
        user, created = get_user_model().objects.get_or_create(username=options["username"])
        if options["password"]:
            user.set_password(options["password"])
        elif created:
            user.set_unusable_password()
        if options["superuser"]:
            user.is_staff = user.is_superuser = True
        user.save()
        user.groups.set([Group.objects.get(name=options["role"])])
        key = api_token_create(user, replace=False)
        self.stderr.write(
            f"{'created' if created else 'updated'} {user.username} with role {options['role']}"
        )
        self.stdout.write(key)
