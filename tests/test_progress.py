"""domainpar.progress: what rank 0 prints, on a terminal and in a log."""
import io

from domainpar.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


class _Rank:
    def __init__(self, rank):
        self.rank = rank

    def Get_rank(self):
        return self.rank


def test_log_gets_first_and_last_lines_only_within_the_rate():
    out = io.StringIO()
    bar = Progress(5, "train", stream=out, every_s=3600)
    for step in range(5):
        bar.update(loss=f"{step:.1f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("train [") and "1/5" in lines[0] and "loss 0.0" in lines[0]
    assert "5/5" in lines[1] and "loss 4.0" in lines[1] and "#" * Progress.WIDTH in lines[1]


def test_terminal_redraws_in_place_and_pads_a_shorter_line():
    out = _Terminal()
    bar = Progress(2, "io", stream=out)
    bar.update(note="a long first note")
    bar.update(note="b")
    bar.close()
    text = out.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n")
    second = text.split("\r")[2].rstrip("\n")
    assert "note b" in second and len(second) >= len(text.split("\r")[1])


def test_other_ranks_print_nothing():
    out = io.StringIO()
    bar = Progress(3, "x", comm=_Rank(1), stream=out, every_s=0)
    for _ in range(3):
        bar.update()
    bar.close(done="yes")
    assert out.getvalue() == ""


def test_unknown_total_and_close_fields():
    out = io.StringIO()
    bar = Progress(None, "scan", stream=out, every_s=0)
    bar.update(2)
    bar.close(files=7)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("scan 2 done") and lines[-1].endswith("files 7")
