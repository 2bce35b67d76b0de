"""Datasets through the API and the CLI: uploads in each format, local paths, clear refusals."""

import io
import json

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from activations.models import Dataset

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(writer, client_for):
    return client_for(writer)


def upload(api, content: bytes, filename: str, **fields):
    handle = io.BytesIO(content)
    handle.name = filename
    return api.post("/api/datasets", {"file": handle, **fields}, format="multipart")


def test_upload_text_lines_jsonl_and_csv(api):
    text = upload(api, "first sample\nsecond sample ✓\nthird\n".encode(), "notes.txt", name="notes")
    assert text.status_code == 201, text.content
    assert text.json()["sample_count"] == 3 and text.json()["format"] == "text_lines"
    assert text.json()["preview"][1] == "second sample ✓"

    jsonl = upload(api, b'{"body": "a"}\n{"body": "b", "x": 1}\n', "data.jsonl", field="body")
    assert jsonl.status_code == 201 and jsonl.json()["sample_count"] == 2

    csv = upload(api, b'id,text\n1,"hello, world"\n2,"two\nlines"\n', "data.csv")
    assert csv.status_code == 201 and csv.json()["sample_count"] == 2
    samples = api.get(f"/api/datasets/{csv.json()['id']}/samples").json()["samples"]
    assert samples == ["hello, world", "two\nlines"]


def test_upload_parquet_reads_its_text_column(api):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.table({"id": [1, 2], "body": ["one row", "another row"]}), buffer)
    response = upload(api, buffer.getvalue(), "rows.parquet", field="body")
    assert response.status_code == 201, response.content
    assert response.json()["format"] == "parquet" and response.json()["field"] == "body"
    samples = api.get(f"/api/datasets/{response.json()['id']}/samples").json()["samples"]
    assert samples == ["one row", "another row"]


def test_a_labelled_upload_keeps_each_samples_class_in_every_format(api):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from activations.services.datasets import dataset_labelled_samples

    csv = upload(
        api, b'text,topic\n"a cat",animals\n"a dog",animals\n"a car",things\n', "t.csv", label_field="topic"
    )
    assert csv.status_code == 201, csv.content
    assert csv.json()["label_field"] == "topic" and csv.json()["classes"] == {"animals": 2, "things": 1}
    jsonl = upload(
        api, b'{"text": "yes", "stars": 5}\n{"text": "no", "stars": 1}\n', "r.jsonl", label_field="stars"
    )
    assert jsonl.json()["classes"] == {"5": 1, "1": 1}  # numbers are read as their text
    buffer = io.BytesIO()
    pq.write_table(pa.table({"text": ["up", "down"], "sign": [True, False]}), buffer)
    parquet = upload(api, buffer.getvalue(), "s.parquet", label_field="sign")
    assert parquet.json()["classes"] == {"true": 1, "false": 1}
    stored = Dataset.objects.get(pk=csv.json()["id"])
    assert dataset_labelled_samples(stored) == [
        ("a cat", "animals"),
        ("a dog", "animals"),
        ("a car", "things"),
    ]
    # the samples read as any dataset's (extraction and training read the text only)
    assert api.get(f"/api/datasets/{stored.id}/samples").json()["samples"] == ["a cat", "a dog", "a car"]


@pytest.mark.parametrize(
    ("content", "filename", "code"),
    [
        (b'text,topic\n"a cat",animals\n', "t.txt", "LABELS_UNSUPPORTED"),  # plain text has no columns
        (b'{"text": "yes"}\n', "r.jsonl", "FIELD_NOT_FOUND"),
        (b'text,kind\n"a",x\n', "t.csv", "FIELD_NOT_FOUND"),
        (b'{"text": "yes", "topic": ""}\n', "r.jsonl", "INVALID_LABEL"),
        (b'{"text": "yes", "topic": [1]}\n', "r.jsonl", "INVALID_LABEL"),
    ],
)
def test_a_bad_label_column_is_a_clear_400_and_writes_nothing(api, content, filename, code):
    response = upload(api, content, filename, label_field="topic")
    assert response.status_code == 400, response.content
    assert response.json()["error"]["code"] == code
    assert not Dataset.objects.exists()


def test_the_same_samples_have_the_same_content_hash(api):
    first = upload(api, b"alpha\nbeta\n", "a.txt").json()
    second = upload(api, b'{"text": "alpha"}\n{"text": "beta"}\n', "b.jsonl").json()
    assert first["content_hash"] == second["content_hash"]


@pytest.mark.parametrize(
    ("content", "filename", "code"),
    [
        (b"caf\xe9 au lait\n", "latin1.txt", "BAD_ENCODING"),
        (b"   \n\n  \n", "blank.txt", "EMPTY_DATASET"),
        (b'{"text": "ok"}\n{not json}\n', "bad.jsonl", "INVALID_FORMAT"),
        (b'{"body": "x"}\n', "nofield.jsonl", "FIELD_NOT_FOUND"),
    ],
)
def test_bad_files_are_400_with_the_reason(api, content, filename, code):
    response = upload(api, content, filename)
    assert response.status_code == 400 and response.json()["error"]["code"] == code
    assert Dataset.objects.count() == 0


def test_a_missing_field_error_lists_a_bounded_number_of_names(api):
    header = ",".join(f"column_{index}" for index in range(1_000_000)).encode()
    response = upload(api, header + b"\n" + b"x," * 999_999 + b"x\n", "wide.csv")
    assert response.status_code == 400 and len(response.content) < 8 * 1024, len(response.content)
    error = response.json()["error"]
    assert error["code"] == "FIELD_NOT_FOUND" and error["details"]["available_fields_count"] == 1_000_000
    assert error["details"]["available_fields"] == [f"column_{index}" for index in range(50)]
    assert error["message"].endswith("'column_49' and 999950 more.")

    record = {f"{index:06d}" + "k" * 5000: 1 for index in range(2000)}
    response = upload(api, json.dumps(record).encode() + b"\n", "wide.jsonl")
    assert response.status_code == 400 and len(response.content) < 32 * 1024, len(response.content)
    details = response.json()["error"]["details"]
    assert details["available_fields_count"] == 2000 and len(details["available_fields"]) == 50
    assert all(len(name) == 200 and name.endswith("…") for name in details["available_fields"])


def test_too_large_is_413(api, settings):
    settings.DATASET_MAX_UPLOAD_BYTES = 100
    response = upload(api, b"x" * 500 + b"\n", "big.txt")
    assert response.status_code == 413 and response.json()["error"]["code"] == "DATASET_TOO_LARGE"


@pytest.mark.parametrize(
    ("content", "filename", "where"),
    [
        (b"short\n" + b"y" * 3000 + b"\nshort\n", "long.txt", {"sample": 2, "line": 2}),
        (b"a\n\nb\nc" + b"\xc3\xa9" * 1100 + b"\n\nd\n", "paragraphs.txt", {"sample": 2, "line": 3}),
        (b'{"text": "a"}\n\n{"text": "' + b"z" * 3000 + b'"}\n', "long.jsonl", {"sample": 2, "line": 3}),
        (b'text\nok\n"' + b"w" * 3000 + b'"\n', "long.csv", {"sample": 2, "line": 3}),
    ],
)
def test_a_sample_over_the_sample_limit_is_400_naming_it(api, settings, content, filename, where):
    settings.DATASET_MAX_SAMPLE_BYTES = 2048
    response = upload(
        api, content, filename, **({"format": "text_paragraphs"} if "paragraphs" in filename else {})
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "SAMPLE_TOO_LARGE" and error["details"]["max_bytes"] == 2048
    assert {key: error["details"][key] for key in where} == where and error["details"]["size_bytes"] > 2048
    assert f"Sample {where['sample']} (line {where['line']})" in error["message"]
    assert Dataset.objects.count() == 0


def test_the_sample_limit_holds_for_local_paths_and_defaults_to_one_mebibyte(api, settings):
    assert settings.DATASET_MAX_SAMPLE_BYTES == 2**20
    root = settings.LOCAL_DATA_ROOTS[0]
    (root / "folder").mkdir(parents=True, exist_ok=True)
    (root / "folder" / "a.txt").write_text("fine\n")
    (root / "folder" / "b.txt").write_text("fine\n" + "é" * (2**19 + 1) + "\n")  # 1 MiB + 2 bytes
    response = api.post("/api/datasets", {"local_path": str(root / "folder")}, format="json")
    assert response.status_code == 400, response.content
    details = response.json()["error"]["details"]
    assert details == {
        "sample": 3,
        "line": 2,
        "file": "b.txt",
        "size_bytes": 2**20 + 2,
        "max_bytes": 2**20,
    }


def test_unknown_fields_are_refused_by_name(api):
    root = settings.LOCAL_DATA_ROOTS[0]
    root.mkdir(parents=True, exist_ok=True)
    (root / "typo.txt").write_text("a sample\n")
    response = api.post(
        "/api/datasets", {"local_path": str(root / "typo.txt"), "share": True, "feild": "x"}, format="json"
    )
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR"
    assert error["details"]["fields"] == {
        "feild": ["Unknown or read-only field."],
        "share": ["Unknown or read-only field."],
    }
    response = upload(api, b"a sample\n", "typo.txt", colum="text")
    assert response.status_code == 400 and list(response.json()["error"]["details"]["fields"]) == ["colum"]
    assert Dataset.objects.count() == 0


def test_neither_or_both_sources_is_a_validation_error(api):
    response = api.post("/api/datasets", {"name": "nothing"}, format="json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "VALIDATION_ERROR"


def test_local_paths_are_confined_to_the_data_roots(api, tmp_path):
    root = settings.LOCAL_DATA_ROOTS[0]
    root.mkdir(parents=True, exist_ok=True)
    (root / "corpus.jsonl").write_text(json.dumps({"text": "inside the root"}) + "\n")
    response = api.post("/api/datasets", {"local_path": str(root / "corpus.jsonl")}, format="json")
    assert response.status_code == 201 and response.json()["sample_count"] == 1
    (tmp_path / "outside.txt").write_text("secret\n")
    for path in [str(tmp_path / "outside.txt"), f"{root}/../../etc/passwd", "relative.txt"]:
        response = api.post("/api/datasets", {"local_path": path}, format="json")
        assert response.status_code == 400 and response.json()["error"]["code"] == "INVALID_LOCAL_PATH"


def test_delete_removes_the_row_and_the_file(api):
    created = upload(api, b"one\ntwo\n", "d.txt").json()
    path = Dataset.objects.get(pk=created["id"]).storage_path
    assert path.exists()
    assert api.delete(f"/api/datasets/{created['id']}").status_code == 204
    assert not path.exists() and api.get(f"/api/datasets/{created['id']}").status_code == 404


def test_readers_cannot_upload(reader, client_for):
    response = upload(client_for(reader), b"x\n", "x.txt")
    assert response.status_code == 403


def test_add_dataset_command():
    root = settings.LOCAL_DATA_ROOTS[0]
    root.mkdir(parents=True, exist_ok=True)
    (root / "paragraphs.txt").write_text("First paragraph\nstill first.\n\nSecond one.\n")
    out = io.StringIO()
    call_command(
        "add_dataset",
        str(root / "paragraphs.txt"),
        "--format",
        "text_paragraphs",
        stdout=out,
        stderr=io.StringIO(),
    )
    dataset = Dataset.objects.get(pk=out.getvalue().strip())
    assert dataset.sample_count == 2 and dataset.preview[0] == "First paragraph\nstill first."
    with pytest.raises(CommandError, match="INVALID_LOCAL_PATH"):
        call_command("add_dataset", "/etc/passwd", stdout=io.StringIO(), stderr=io.StringIO())
