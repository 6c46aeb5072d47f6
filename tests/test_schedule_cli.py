"""`meshtron schedule`, run in-process: the action table, the bubble lines, the timeline PNG."""

from __future__ import annotations

from meshtron.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_schedule_prints_the_table_and_writes_a_png(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["schedule", "--schedule", "1f1b", "--pp", "2", "--microbatches", "3"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert "stage 0: F0 F1 B0 F2 B1 B2" in lines
    assert "stage 1: F0 B0 F1 B1 F2 B2" in lines
    assert "communication: 6 sends and 6 receive posts (not shown above), each posted 1 ahead" \
        in lines
    assert "bubble fraction (F=1, B=2): theory 0.2500, simulated 0.2500" in lines
    assert "peak in-flight micro-batches per stage: 2 1" in lines
    png = tmp_path / "schedule-1f1b-pp2-vpp1-m3.png"
    assert lines[-1] == f"timeline: {png.name}"
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_interleaved_table_shows_chunks_and_out_sets_the_path(tmp_path, capsys):
    out_png = tmp_path / "plots" / "interleaved.png"
    code = main(["schedule", "--schedule", "interleaved", "--pp", "2", "--vpp", "2",
                 "--microbatches", "4", "--out", str(out_png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "stage 1: F0.0 F1.0 F0.1 B0.1 " in out
    assert "theory 0.1111, simulated 0.1111" in out
    assert out.splitlines()[-1] == f"timeline: {out_png}"
    assert out_png.read_bytes().startswith(PNG_MAGIC)


def test_bad_schedule_input_exits_non_zero_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["schedule", "--schedule", "interleaved", "--pp", "4", "--vpp", "2",
                 "--microbatches", "6"])
    captured = capsys.readouterr()
    assert code != 0
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron: error: ")
    assert "multiple of pp=4" in lines[0]
    assert not list(tmp_path.iterdir())
