from django.db import migrations


class Migration(migrations.Migration):
    """A generation ends at ``finished_at``, as every job row does (its JSON still says ``completed_at``)."""

    dependencies = [
        ("generation", "0004_generation_work_and_progress"),
    ]

    operations = [
        migrations.RenameField(model_name="generation", old_name="completed_at", new_name="finished_at"),
    ]
