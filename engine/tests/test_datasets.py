"""Parsing researcher-provided datasets: every format, the encodings and the refusals."""

import json
import os
import time
from pathlib import Path

import pytest

from engine.datasets import (
    FORMATS,
    DatasetError,
    content_hash,
    guess_format,
    parse_bytes,
    parse_path,
    preview,
)
from engine.datasets import files as dataset_files

MAX = 1024 * 1024
SAMPLES = ["Grüße aus Köln — naïve café", "emoji 🧠🔬 and 漢字", 'a "quoted", comma']


def parse(data: bytes | str, format: str, **kwargs):
    if isinstance(data, str):
        data = data.encode("utf-8")
    return parse_bytes(data, format=format, max_bytes=kwargs.pop("max_bytes", MAX), **kwargs)


def refusal(code: str, function, *args, **kwargs) -> DatasetError:
    with pytest.raises(DatasetError) as caught:
        function(*args, **kwargs)
    assert caught.value.code == code, caught.value
    return caught.value


# --- happy paths ---------------------------------------------------------------------------------


def test_text_lines_keeps_unicode_and_drops_blank_lines_and_crlf():
    data = "  Grüße aus Köln  \r\n\r\n🧠 emoji\u2028same line\r\n   \r\nlast line without newline"
    parsed = parse(data, "text_lines")
    assert parsed.samples == ["Grüße aus Köln", "🧠 emoji\u2028same line", "last line without newline"]
    assert parsed.format == "text_lines"
    assert parsed.field is None
    assert parsed.skipped_empty == 2
    assert parsed.size_bytes == len(data.encode())


def test_text_paragraphs_split_on_blank_lines_and_keep_inner_newlines():
    data = (
        "\r\n\r\nFirst paragraph,\r\nsecond line.\r\n\r\n \t \r\n\r\n"
        "  Zweiter Absatz 🎉\nnoch eine Zeile  \n\n\nlast"
    )
    parsed = parse(data, "text_paragraphs")
    assert parsed.samples == [
        "First paragraph,\nsecond line.",
        "Zweiter Absatz 🎉\nnoch eine Zeile",
        "last",
    ]
    assert parsed.skipped_empty == 0


def test_jsonl_reads_the_field_and_ignores_extra_keys_and_blank_lines():
    lines = [
        json.dumps({"id": 1, "text": SAMPLES[0], "meta": {"lang": "de"}}),
        "",
        json.dumps({"text": SAMPLES[1], "score": 0.5}, ensure_ascii=False),
        '{"text": "escaped \\u00e9 and \\ud83e\\udde0", "tags": ["a", "b"]}',
        json.dumps({"text": "   "}),
        json.dumps({"text": 'a "quoted", comma'}),
    ]
    parsed = parse("\r\n".join(lines) + "\r\n\r\n", "jsonl")
    assert parsed.samples == [SAMPLES[0], SAMPLES[1], "escaped é and 🧠", 'a "quoted", comma']
    assert parsed.field == "text"
    assert parsed.skipped_empty == 1


def test_jsonl_and_csv_read_a_chosen_field():
    jsonl = "\n".join(json.dumps({"prompt": sample, "text": "other"}) for sample in SAMPLES)
    assert parse(jsonl, "jsonl", field="prompt").samples == SAMPLES
    csv_data = 'id,prompt\n1,"one, two"\n2,three\n'
    parsed = parse(csv_data, "csv", field="prompt")
    assert parsed.samples == ["one, two", "three"]
    assert parsed.field == "prompt"


def test_csv_handles_quoted_commas_quotes_newlines_and_crlf():
    data = (
        'id,text,label\r\n1,"Hello, world",x\r\n2,"She said ""hi""\r\nand left",y\r\n'
        '3,Grüße 🧠,z\r\n\r\n4,,empty\r\n5,"multi\nline\nüber",w'
    )
    parsed = parse(data, "csv")
    assert parsed.samples == [
        "Hello, world",
        'She said "hi"\r\nand left',
        "Grüße 🧠",
        "multi\nline\nüber",
    ]
    assert parsed.skipped_empty == 1


def test_csv_skips_blank_lines_before_the_header_and_between_rows():
    parsed = parse("\r\n\r\ntext,n\r\none,1\r\n   \r\n\r\n two ,2\r\n", "csv")
    assert parsed.samples == ["one", " two "]
    assert parsed.skipped_empty == 0


@pytest.mark.parametrize(
    ("format", "data", "expected"),
    [
        ("text_lines", "first\nsecond\n", ["first", "second"]),
        ("text_paragraphs", "first\n\nsecond\n", ["first", "second"]),
        ("jsonl", '{"text": "first"}\n{"text": "second"}\n', ["first", "second"]),
        ("csv", "text,n\nfirst,1\nsecond,2\n", ["first", "second"]),
    ],
)
def test_a_utf8_byte_order_mark_is_dropped(format, data, expected):
    assert parse(b"\xef\xbb\xbf" + data.encode(), format).samples == expected


# --- refusals ------------------------------------------------------------------------------------


def test_latin1_bytes_are_bad_encoding_with_their_position():
    data = "first line\nsecond line\nGr\u00fc\u00dfe".encode("latin-1")
    error = refusal("BAD_ENCODING", parse, data, "text_lines")
    assert error.details["byte_offset"] == data.index(b"\xfc") == 25
    assert error.details["line"] == 3
    assert error.details["byte"] == "0xfc"
    assert "offset 25" in error.message


def test_bad_encoding_offsets_count_the_byte_order_mark():
    error = refusal("BAD_ENCODING", parse, b"\xef\xbb\xbfab\xff", "text_lines")
    assert error.details["byte_offset"] == 5


def test_utf16_is_bad_encoding():
    error = refusal("BAD_ENCODING", parse, "text\nhello\n".encode("utf-16"), "csv")
    assert error.details["encoding"] == "UTF-16"


def test_nul_bytes_mean_a_binary_file():
    error = refusal("INVALID_FORMAT", parse, b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "text_lines")
    assert "binary" in error.message


@pytest.mark.parametrize("format", ["text_lines", "text_paragraphs", "jsonl", "csv"])
@pytest.mark.parametrize("data", [b"", b"\xef\xbb\xbf", b"  \n\t\r\n \n"])
def test_empty_or_whitespace_only_is_an_empty_dataset(format, data):
    refusal("EMPTY_DATASET", parse, data, format)


@pytest.mark.parametrize(
    ("format", "data"),
    [("jsonl", '{"text": "  "}\n{"text": ""}\n'), ("csv", 'text\n""\n"   "\n')],
)
def test_only_empty_values_are_an_empty_dataset(format, data):
    error = refusal("EMPTY_DATASET", parse, data, format)
    assert error.details["skipped_empty"] == 2


def test_jsonl_missing_field_lists_the_fields_of_that_line():
    data = '{"text": "ok"}\n\n{"prompt": "p", "id": 3}\n'
    error = refusal("FIELD_NOT_FOUND", parse, data, "jsonl")
    assert error.details["line"] == 3
    assert error.details["available_fields"] == ["id", "prompt"]
    assert "'prompt'" in error.message and "line 3" in error.message.lower()


def test_malformed_json_names_the_line():
    data = '{"text": "one"}\r\n{"text": "two"}\r\n{"text": "three",}\r\n'
    error = refusal("INVALID_FORMAT", parse, data, "jsonl")
    assert error.details["line"] == 3
    assert "Line 3" in error.message


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('["text"]', "array"),
        ('"just a string"', "string"),
        ('{"text": 5}', "number"),
        ('{"text": null}', "null"),
    ],
)
def test_jsonl_lines_must_be_objects_with_a_string_field(line, reason):
    error = refusal("INVALID_FORMAT", parse, '{"text": "fine"}\n' + line, "jsonl")
    assert error.details["line"] == 2
    assert reason in error.message


def test_jsonl_unpaired_surrogates_are_refused():
    error = refusal("INVALID_FORMAT", parse, '{"text": "broken \\ud800 half"}', "jsonl")
    assert error.details["line"] == 1


def test_csv_missing_column_lists_the_columns():
    error = refusal("FIELD_NOT_FOUND", parse, "id,prompt,label\n1,hello,x\n", "csv")
    assert error.details["available_fields"] == ["id", "prompt", "label"]
    assert "'prompt'" in error.message


@pytest.mark.parametrize(
    ("data", "line"),
    [
        ('text,n\n"fine",1\n"never closed,2\nmore\n', 3),
        ('text,n\nok,1\n"closed" then text,2\n', 3),
        ("text,n\nok,1\nan unquoted, comma,3\n", 3),
        ('text,n\n"spans\ntwo lines",1\ntoo,few,cells,here\n', 4),
    ],
)
def test_malformed_csv_is_invalid_format_near_its_line(data, line):
    error = refusal("INVALID_FORMAT", parse, data, "csv")
    assert error.details["line"] == line


def test_too_large_bytes_are_refused_before_parsing():
    data = b"\xff" * 101  # would be BAD_ENCODING if it were parsed
    error = refusal("DATASET_TOO_LARGE", parse, data, "text_lines", max_bytes=100)
    assert error.details == {"max_bytes": 100, "size_bytes": 101}


def test_too_large_file_is_refused_from_its_size_without_reading_it(tmp_path, monkeypatch):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as handle:
        handle.truncate(8 * 1024**3)  # sparse: reading it would take many seconds and 8 GiB

    def no_reading(*args, **kwargs):
        raise AssertionError("the file was read")

    monkeypatch.setattr(dataset_files, "_read_bounded", no_reading)
    started = time.monotonic()
    error = refusal("DATASET_TOO_LARGE", parse_path, huge, format=None, field=None, max_bytes=MAX)
    assert time.monotonic() - started < 1
    assert error.details == {"max_bytes": MAX, "size_bytes": 8 * 1024**3}


def test_folder_size_is_the_total_of_its_files(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 60 + "\n")
    (tmp_path / "b.txt").write_text("y" * 60 + "\n")
    error = refusal("DATASET_TOO_LARGE", parse_path, tmp_path, format=None, field=None, max_bytes=100)
    assert error.details["size_bytes"] == 122


def test_max_samples_is_enforced():
    error = refusal("TOO_MANY_SAMPLES", parse, "a\nb\nc\n", "text_lines", max_samples=2)
    assert error.details == {"max_samples": 2}
    assert parse("a\nb\n\n", "text_lines", max_samples=2).samples == ["a", "b"]


def test_unknown_format_is_refused():
    error = refusal("INVALID_FORMAT", parse, "a", "xml")
    assert error.details["formats"] == FORMATS
    refusal("INVALID_FORMAT", parse, "a", "hf_disk")


# --- files and folders ---------------------------------------------------------------------------


def test_parse_path_guesses_the_format_of_a_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps({"text": s}) for s in SAMPLES).encode())
    parsed = parse_path(path, format=None, field=None, max_bytes=MAX)
    assert (parsed.format, parsed.samples, parsed.size_bytes) == ("jsonl", SAMPLES, path.stat().st_size)


def test_parse_path_refuses_pickles_and_missing_paths(tmp_path):
    pickled = tmp_path / "samples.pkl"
    pickled.write_bytes(b"\x80\x04\x95")
    refusal("INVALID_FORMAT", parse_path, pickled, format="text_lines", field=None, max_bytes=MAX)
    refusal("NOT_FOUND", parse_path, tmp_path / "absent.txt", format=None, field=None, max_bytes=MAX)


def test_a_folder_of_text_files_is_read_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("third\nfourth\n", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first\r\nsecond 🧠\r\n", encoding="utf-8")
    (tmp_path / "c.TXT").write_text("fifth\n", encoding="utf-8")
    (tmp_path / ".hidden.txt").write_text("hidden\n", encoding="utf-8")
    (tmp_path / "README.md").write_text("# not a sample\n", encoding="utf-8")
    (tmp_path / "cache.pkl").write_bytes(b"\x80\x04\x95 never opened")
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "deeper.txt").write_text("not read\n", encoding="utf-8")
    parsed = parse_path(tmp_path, format=None, field=None, max_bytes=MAX)
    assert parsed.samples == ["first", "second 🧠", "third", "fourth", "fifth"]
    assert parsed.format == "text_lines"


def test_a_folder_of_paragraphs_is_guessed_unless_the_format_is_chosen(tmp_path):
    (tmp_path / "a.txt").write_text("One\nstill one.\n\nTwo\nstill two.\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("Three\nstill three.\n", encoding="utf-8")
    parsed = parse_path(tmp_path, format=None, field=None, max_bytes=MAX)
    assert parsed.format == "text_paragraphs"
    assert parsed.samples == ["One\nstill one.", "Two\nstill two.", "Three\nstill three."]
    parsed = parse_path(tmp_path, format="text_lines", field=None, max_bytes=MAX)
    assert parsed.format == "text_lines"
    assert len(parsed.samples) == 6


def test_a_folder_error_names_the_file(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n', encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n{"prompt": "no"}\n', encoding="utf-8")
    error = refusal("FIELD_NOT_FOUND", parse_path, tmp_path, format=None, field=None, max_bytes=MAX)
    assert error.details["file"] == "b.jsonl"
    assert error.details["line"] == 2


def test_a_folder_must_not_mix_formats_unless_one_is_chosen(tmp_path):
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")
    (tmp_path / "b.csv").write_text("text\ntwo\n", encoding="utf-8")
    refusal("INVALID_FORMAT", parse_path, tmp_path, format=None, field=None, max_bytes=MAX)
    parsed = parse_path(tmp_path, format="text_lines", field=None, max_bytes=MAX)
    assert parsed.samples == ["one", "text", "two"]


def test_a_folder_without_dataset_files_is_refused(tmp_path):
    (tmp_path / "notes.md").write_text("hello\n", encoding="utf-8")
    refusal("INVALID_FORMAT", parse_path, tmp_path, format=None, field=None, max_bytes=MAX)


def test_a_symlink_leaving_the_folder_is_not_read(tmp_path):
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("do not read me\n", encoding="utf-8")
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "a.txt").write_text("fine\n", encoding="utf-8")
    (folder / "b.txt").symlink_to(secret)
    error = refusal("UNSAFE_PATH", parse_path, folder, format=None, field=None, max_bytes=MAX)
    assert error.details == {"file": "b.txt"}
    assert "do not read me" not in error.message


def test_a_symlink_staying_inside_the_folder_is_followed(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "real.txt").write_text("linked sample\n", encoding="utf-8")
    (tmp_path / "a.txt").symlink_to(tmp_path / "store" / "real.txt")
    assert parse_path(tmp_path, format=None, field=None, max_bytes=MAX).samples == ["linked sample"]


# --- save_to_disk folders ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved Dataset and two saved DatasetDicts (with and without a train split)."""
    import datasets

    root = tmp_path_factory.mktemp("saved")
    single = datasets.Dataset.from_dict(
        {
            "text": [SAMPLES[0], None, SAMPLES[1], "  ", SAMPLES[2]],
            "label": [0, 1, 2, 3, 4],
            "title": list("abcde"),
        }
    )
    single.save_to_disk(root / "single")
    train = datasets.Dataset.from_dict({"text": ["train one", "train two"]})
    test = datasets.Dataset.from_dict({"text": ["test one"]})
    datasets.DatasetDict({"test": test, "train": train}).save_to_disk(root / "with_train")
    datasets.DatasetDict({"validation": test, "extra": train}).save_to_disk(root / "without_train")
    return root


def test_a_saved_dataset_is_read_from_its_text_column(saved):
    parsed = parse_path(saved / "single", format=None, field=None, max_bytes=MAX)
    assert parsed.samples == SAMPLES
    assert (parsed.format, parsed.field, parsed.split, parsed.skipped_empty) == ("hf_disk", "text", None, 2)
    arrow_bytes = sum(path.stat().st_size for path in (saved / "single").glob("*.arrow"))
    assert parsed.size_bytes == arrow_bytes


def test_a_saved_dataset_column_can_be_chosen(saved):
    parsed = parse_path(saved / "single", format="hf_disk", field="title", max_bytes=MAX)
    assert parsed.samples == list("abcde")
    single = saved / "single"
    error = refusal("FIELD_NOT_FOUND", parse_path, single, format=None, field="prompt", max_bytes=MAX)
    assert error.details["available_fields"] == ["text", "label", "title"]
    error = refusal("INVALID_FORMAT", parse_path, single, format=None, field="label", max_bytes=MAX)
    assert "int64" in error.message


def test_a_saved_dataset_dict_reads_train_or_the_first_split(saved):
    parsed = parse_path(saved / "with_train", format=None, field=None, max_bytes=MAX)
    assert (parsed.samples, parsed.split) == (["train one", "train two"], "train")
    parsed = parse_path(saved / "without_train", format=None, field=None, max_bytes=MAX)
    assert (parsed.samples, parsed.split) == (["test one"], "validation")
    parsed = parse_path(saved / "with_train", format=None, field=None, max_bytes=MAX, split="test")
    assert parsed.samples == ["test one"]
    with_train = saved / "with_train"
    error = refusal(
        "SPLIT_NOT_FOUND", parse_path, with_train, format=None, field=None, max_bytes=MAX, split="dev"
    )
    assert error.details["available_splits"] == ["test", "train"]


def test_a_saved_dataset_sample_over_the_sample_limit_names_its_row(saved):
    longest = max(len(sample.encode()) for sample in SAMPLES)
    parse_path(saved / "single", format=None, field=None, max_bytes=MAX, max_sample_bytes=longest)
    error = refusal(
        "SAMPLE_TOO_LARGE",
        parse_path,
        saved / "single",
        format=None,
        field=None,
        max_bytes=MAX,
        max_sample_bytes=longest - 1,
    )
    index = next(i for i, sample in enumerate(SAMPLES) if len(sample.encode()) == longest)
    row = [0, 2, 4][index]  # the column is SAMPLES with a null and a blank between them
    assert error.details == {"sample": index + 1, "row": row, "size_bytes": longest, "max_bytes": longest - 1}


def test_a_saved_dataset_over_the_size_limit_is_refused_before_loading(saved):
    error = refusal("DATASET_TOO_LARGE", parse_path, saved / "single", format=None, field=None, max_bytes=10)
    assert error.details["size_bytes"] > 10


def test_hf_disk_needs_a_save_to_disk_folder(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n", encoding="utf-8")
    refusal("INVALID_FORMAT", parse_path, tmp_path, format="hf_disk", field=None, max_bytes=MAX)
    refusal("INVALID_FORMAT", parse_path, tmp_path / "a.txt", format="hf_disk", field=None, max_bytes=MAX)


def copy_tree(source: Path, target: Path) -> None:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())


def test_a_saved_dataset_whose_arrow_file_links_outside_is_not_loaded(saved, tmp_path):
    folder = tmp_path / "linked"
    copy_tree(saved / "single", folder)
    arrow = next(folder.glob("*.arrow"))
    outside = tmp_path / "outside.arrow"
    arrow.rename(outside)
    arrow.symlink_to(outside)
    error = refusal("UNSAFE_PATH", parse_path, folder, format=None, field=None, max_bytes=MAX)
    assert error.details["file"] == arrow.name


def test_a_saved_dataset_state_may_not_name_files_outside(saved, tmp_path):
    folder = tmp_path / "escaping"
    copy_tree(saved / "single", folder)
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere/data.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    refusal("INVALID_FORMAT", parse_path, folder, format=None, field=None, max_bytes=MAX)


def test_a_saved_dataset_dict_split_may_not_leave_the_folder(tmp_path):
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["../outside"]}))
    refusal("INVALID_FORMAT", parse_path, tmp_path, format=None, field=None, max_bytes=MAX)


# --- hashing, guessing, preview ------------------------------------------------------------------


def test_content_hash_depends_on_the_samples_not_the_format(saved, tmp_path):
    samples = [SAMPLES[0], "line with, comma", "emoji 🧠"]
    (tmp_path / "s.txt").write_text("\r\n".join(samples) + "\r\n", encoding="utf-8")
    jsonl = "\n".join(json.dumps({"text": sample, "n": 1}) for sample in samples)
    (tmp_path / "s.jsonl").write_text(jsonl, encoding="utf-8")
    csv_rows = "".join(f'"{s}",x\n' for s in samples)
    (tmp_path / "s.csv").write_bytes(b"\xef\xbb\xbf" + f"text,other\n{csv_rows}".encode())
    hashes = {
        content_hash(parse_path(tmp_path / name, format=None, field=None, max_bytes=MAX).samples)
        for name in ("s.txt", "s.jsonl", "s.csv")
    }
    assert hashes == {content_hash(samples)}
    hf_samples = parse_path(saved / "single", format=None, field=None, max_bytes=MAX).samples
    assert content_hash(hf_samples) == content_hash(list(SAMPLES))

    assert len(content_hash(samples)) == 64
    assert content_hash(samples) != content_hash([*samples[:2], "emoji 🧠 "])
    assert content_hash(samples) != content_hash(list(reversed(samples)))
    assert content_hash(["ab"]) != content_hash(["a", "b"])
    assert content_hash(["a", ""]) != content_hash(["a"])


@pytest.mark.parametrize(
    ("filename", "head", "expected"),
    [
        ("prompts.txt", b"one\ntwo\nthree\n", "text_lines"),
        ("PROMPTS.TXT", b"one\ntwo\n", "text_lines"),
        ("notes.text", b"one\n\ntwo\n\nthree\n", "text_lines"),
        ("notes.txt", "first sample\nsecond ✓\n\nthird\n".encode(), "text_lines"),
        ("essay.txt", b"Para one\nstill one.\n\nPara two\nstill two.\n\nPara 3\nend.\n", "text_paragraphs"),
        ("essay.txt", b"Para one\r\nstill one.\r\n\r\nPara two\r\nstill two.\r\n", "text_paragraphs"),
        ("list.txt", b"".join(b"prompt %d\n" % n for n in range(200)) + b"\nlast\nfinal\n", "text_lines"),
        ("data.jsonl", b'{"text": "a"}\n', "jsonl"),
        ("data.ndjson", b"", "jsonl"),
        ("data.json", b'\xef\xbb\xbf {"text": "a"}\n', "jsonl"),
        ("table.csv", b"text\na\n", "csv"),
    ],
)
def test_guess_format(filename, head, expected):
    assert guess_format(filename, head) == expected


@pytest.mark.parametrize("filename", ["data.json", "data.feather", "samples.pkl", "no_extension"])
def test_guess_format_refuses_what_it_cannot_read(filename):
    head = b'[{"text": "a"}]' if filename.endswith(".json") else b"abc"
    error = refusal("INVALID_FORMAT", guess_format, filename, head)
    assert ".jsonl" in error.details["known_extensions"]


def test_preview_shows_the_first_samples_cut_short():
    samples = ["short", "x" * 500, "third", "fourth"]
    shown = preview(samples, count=3, max_chars=10)
    assert shown == ["short", "x" * 9 + "…", "third"]
    assert preview(samples) == ["short", "x" * 299 + "…", "third", "fourth"]
    assert preview([], count=5) == []


def test_the_module_imports_without_django_or_datasets():
    import subprocess
    import sys

    code = (
        "import sys; import engine.datasets as d; "
        "assert 'django' not in sys.modules and 'datasets' not in sys.modules, sorted(sys.modules); "
        "print(d.parse_bytes(b'a\\n', format='text_lines', max_bytes=10).samples)"
    )
    environment = {key: value for key, value in os.environ.items() if key != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['a']"


def test_a_parquet_file_gives_its_text_column_row_group_by_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {"text": ["first sample", None, "  ", "third, with a comma", "é ünïcode"], "n": [1, 2, 3, 4, 5]}
    )
    path = tmp_path / "corpus.parquet"
    pq.write_table(table, path, row_group_size=2)  # three row groups
    parsed = parse_path(path, format=None, field=None, max_bytes=10**6)
    assert parsed.format == "parquet" and parsed.field == "text"
    assert parsed.samples == ["first sample", "third, with a comma", "é ünïcode"]
    assert parsed.skipped_empty == 2  # the null and the blank
    with pytest.raises(DatasetError) as missing:
        parse_path(path, format=None, field="body", max_bytes=10**6)
    assert missing.value.code == "FIELD_NOT_FOUND" and missing.value.details["available_fields"] == [
        "text",
        "n",
    ]
    with pytest.raises(DatasetError) as numbers:
        parse_path(path, format=None, field="n", max_bytes=10**6)
    assert numbers.value.code == "INVALID_FORMAT" and "int64" in numbers.value.message
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(path.read_bytes()[:40])
    with pytest.raises(DatasetError) as damaged:
        parse_path(broken, format=None, field=None, max_bytes=10**6)
    assert damaged.value.code == "INVALID_FORMAT"
    with pytest.raises(DatasetError) as too_large:
        parse_path(path, format=None, field=None, max_bytes=100)
    assert too_large.value.code == "DATASET_TOO_LARGE"
