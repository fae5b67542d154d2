"""`pytest-gpumem history` follows git as people use it: the first-parent line of the branch gated, merges
read as the file they hold, renames followed and copies not, odd subjects and file names read, bad dates
refused, a byte slack in the gate, and outputs that cannot overwrite each other or carry raw HTML. Each
scratch repository is built once per module (dates fixed; the test_history helpers)."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_history import FILE, baselines, git
from test_history_html import page

from cuda_allocator_model import byte_range
from pytest_gpumem.cli import main

KIB = 1024


def init(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    for key, value in (("user.name", "Tester"), ("user.email", "t@example.com"), ("commit.gpgsign", "false")):
        git(path, "config", key, value)
    return path


def save(repo: Path, peaks: dict[str, int], subject: str, day: int, name: str = FILE) -> str:
    """Write the baseline file `name` holding `peaks`, commit everything, return the short hash."""
    (repo / name).parent.mkdir(parents=True, exist_ok=True)
    (repo / name).write_text(baselines(peaks))
    return record(repo, subject, day)


def record(repo: Path, subject: str, day: int) -> str:
    git(repo, "add", "-A", day=day)
    git(repo, "commit", "-q", "-m", subject, day=day)
    return short(repo)


def short(repo: Path) -> str:
    return git(repo, "rev-parse", "--short", "HEAD").strip()


def merge(repo: Path, branch: str, day: int, *flags: str) -> str:
    git(repo, "merge", "-q", "--no-ff", "-m", f"Merge {branch}", *flags, branch, day=day)
    return short(repo)


def points(repo: Path, tmp_path: Path, *args: str, file: str = FILE) -> list[list[object]]:
    """The call series' points of the only test, from `--json`."""
    out = tmp_path / "all.json"
    assert main(["history", str(repo / file), "--json", str(out), *args]) in (0, 1)
    calls = [s for s in json.loads(out.read_text())["series"] if s["phase"] == "call"]
    assert len(calls) == 1
    return list(calls[0]["points"])


# ------------------------------------------------------------------ merges, in first-parent order


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A side branch doubles the test (a commit dated after the merge) and is merged cleanly."""
    repo = init(tmp_path_factory.mktemp("clean") / "repo")
    first = save(repo, {"t.py::test_a": 100}, "start", 1)
    git(repo, "checkout", "-q", "-b", "side")
    save(repo, {"t.py::test_a": 200}, "side doubles it", 9)
    git(repo, "checkout", "-q", "main")
    (repo / "README").write_text("x\n")
    unrelated = record(repo, "unrelated", 3)
    return repo, [first, unrelated, merge(repo, "side", 4)]


def test_a_clean_merge_is_read_as_the_file_it_holds(
    clean: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, (first, _, merged) = clean
    assert points(repo, tmp_path) == [[first, 100], [merged, 200]]
    assert main(["history", str(repo / FILE), "--max-growth", "50", "--slack", "0"]) == 1
    out = capsys.readouterr().out
    assert f"  call     100 B   200 B  +100 B  +100.0%      1        +100 B  {merged} 2026-11-04 Merge side\n" in out
    assert out.splitlines()[-2].startswith("grew: t.py::test_a [tracker cpu] call: 100 B -> 200 B (+100.0%")


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """git-flow: v1 tags a release branch's commit (400 B), merged into main after an unrelated commit;
    main then grows the test by 5%."""
    repo = init(tmp_path_factory.mktemp("release") / "repo")
    save(repo, {"t.py::test_a": 100}, "start", 1)
    git(repo, "checkout", "-q", "-b", "release")
    tagged = save(repo, {"t.py::test_a": 400}, "release 1", 2)
    git(repo, "tag", "v1")
    git(repo, "checkout", "-q", "main")
    (repo / "README").write_text("x\n")
    record(repo, "unrelated", 3)
    merged = merge(repo, "release", 4)
    return repo, [tagged, merged, save(repo, {"t.py::test_a": 420}, "grows 5%", 5)]


def test_since_a_tag_on_a_merged_release_branch_starts_from_the_file_as_the_tag_holds_it(
    release: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, (tagged, merged, grown) = release
    assert points(repo, tmp_path, "--since", "v1") == [[tagged, 400], [merged, 400], [grown, 420]]
    assert main(["history", str(repo / FILE), "--since", "v1", "--max-growth", "10", "--slack", "0"]) == 0
    assert main(["history", str(repo / FILE), "--since", "v1", "--max-growth", "4", "--slack", "0"]) == 1
    assert "grew since v1: t.py::test_a [tracker cpu] call: 400 B -> 420 B (+5.0%" in capsys.readouterr().out


@pytest.fixture(scope="module")
def both_sides(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Main and a side branch each change another test of the file; the merge is clean (git merges the
    two hunks) and holds the side branch's 200 B for test_a, main's later commit 100 B."""
    repo = init(tmp_path_factory.mktemp("both") / "repo")
    first = save(repo, {"t.py::test_a": 100, "t.py::test_z": 10}, "start", 1)
    git(repo, "checkout", "-q", "-b", "side")
    save(repo, {"t.py::test_a": 200, "t.py::test_z": 10}, "side doubles test_a", 2)
    git(repo, "checkout", "-q", "main")
    other = save(repo, {"t.py::test_a": 100, "t.py::test_z": 20}, "main doubles test_z", 3)
    return repo, [first, other, merge(repo, "side", 4)]


def test_a_clean_merge_of_both_sides_holds_what_the_merge_holds(
    both_sides: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, (_, _, merged) = both_sides
    assert main(["history", str(repo / FILE), "--no-sparklines"]) == 0
    out = capsys.readouterr().out
    assert f"  call     100 B   200 B  +100 B  +100.0%      1        +100 B  {merged} 2026-11-04 Merge side\n" in out
    assert main(["history", str(repo / FILE), "--max-growth", "50", "--slack", "0"]) == 1
    out = capsys.readouterr().out
    assert f"grew: t.py::test_a [tracker cpu] call: 100 B -> 200 B (+100.0%, more than 50%) in 1 step: {merged}" in out


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A side branch grows the test by 800%, merged with `-s ours`: main keeps its own file."""
    repo = init(tmp_path_factory.mktemp("ours") / "repo")
    first = save(repo, {"t.py::test_a": 100}, "start", 1)
    git(repo, "checkout", "-q", "-b", "side")
    save(repo, {"t.py::test_a": 900}, "side grows it", 2)
    git(repo, "checkout", "-q", "main")
    grown = save(repo, {"t.py::test_a": 105}, "main grows it a little", 3)
    return repo, [first, grown, merge(repo, "side", 4, "-s", "ours")]


def test_a_merge_that_keeps_ours_never_shows_the_side_branch(
    ours: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, (first, grown, _) = ours
    assert points(repo, tmp_path) == [[first, 100], [grown, 105]]
    assert main(["history", str(repo / FILE), "--max-growth", "10", "--slack", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no phase grew more than 10%"


@pytest.fixture(scope="module")
def conflict(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Both branches change the test; the merge conflicts and is resolved to a third figure."""
    repo = init(tmp_path_factory.mktemp("conflict") / "repo")
    first = save(repo, {"t.py::test_a": 100}, "start", 1)
    git(repo, "checkout", "-q", "-b", "side")
    save(repo, {"t.py::test_a": 300}, "side", 2)
    git(repo, "checkout", "-q", "main")
    ours = save(repo, {"t.py::test_a": 150}, "main", 3)
    done = subprocess.run(["git", "merge", "-q", "side"], cwd=repo, capture_output=True, check=False)
    assert done.returncode == 1  # the conflict
    return repo, [first, ours, save(repo, {"t.py::test_a": 250}, "Merge side, resolved", 4)]


def test_a_resolved_conflict_is_read(conflict: tuple[Path, list[str]], tmp_path: Path) -> None:
    repo, (first, ours, resolved) = conflict
    assert points(repo, tmp_path) == [[first, 100], [ours, 150], [resolved, 250]]


def test_reports_at_a_side_branch_commit_are_not_in_the_history(
    clean: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, _ = clean
    side = git(repo, "rev-parse", "side").strip()
    (tmp_path / "ci").mkdir()
    text = json.dumps({"version": 1, "backend": "tracker", "device": "cpu", "commit": {"sha": side, "dirty": False},
                       "tests": []})  # fmt: skip
    (tmp_path / "ci" / "side.json").write_text(text)
    assert main(["history", str(repo / FILE), "--reports", str(tmp_path / "ci")]) == 0
    assert f"made at {side[:12]}, which is not in the history read" in capsys.readouterr().err


# ------------------------------------------------------------------ renames followed, copies not


@pytest.fixture(scope="module")
def copied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """`other.json` has a history of its own; the baseline file starts as a copy of it (both kept)."""
    repo = init(tmp_path_factory.mktemp("copied") / "repo")
    save(repo, {"t.py::test_a": 1000}, "other starts", 1, name="other.json")
    save(repo, {"t.py::test_a": 5000}, "other grows", 2, name="other.json")
    shutil.copy(repo / "other.json", repo / FILE)
    copy = record(repo, "start from a copy", 3)
    return repo, [copy, save(repo, {"t.py::test_a": 6000}, "grow", 4)]


def test_a_copy_starts_its_own_history(copied: tuple[Path, list[str]], tmp_path: Path) -> None:
    repo, (copy, grown) = copied
    assert points(repo, tmp_path) == [[copy, 5000], [grown, 6000]]


@pytest.fixture(scope="module")
def renamed_on_a_branch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Main grows `old.json`; a side branch renames it to the baseline file; the merge brings the rename."""
    repo = init(tmp_path_factory.mktemp("renamed") / "repo")
    first = save(repo, {"t.py::test_a": 1000}, "old name", 1, name="old.json")
    git(repo, "checkout", "-q", "-b", "side")
    git(repo, "mv", "old.json", FILE)
    record(repo, "rename", 2)
    git(repo, "checkout", "-q", "main")
    grown = save(repo, {"t.py::test_a": 1200}, "grow under the old name", 3, name="old.json")
    git(repo, "merge", "-q", "--no-ff", "--no-commit", "side")
    assert (repo / FILE).read_text() == baselines({"t.py::test_a": 1200}) and not (repo / "old.json").exists()
    return repo, [first, grown, record(repo, "Merge side", 4)]


def test_a_rename_merged_from_a_branch_is_followed(renamed_on_a_branch: tuple[Path, list[str]], tmp_path: Path) -> None:
    repo, (first, grown, merged) = renamed_on_a_branch
    assert points(repo, tmp_path) == [[first, 1000], [grown, 1200], [merged, 1200]]


# ------------------------------------------------------------------ odd subjects and file names


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Two commits whose subject holds control characters, git's own record separator and bytes that are
    not UTF-8 (written as a raw commit object: `git commit` would re-encode them)."""
    repo = init(tmp_path_factory.mktemp("odd") / "repo")
    parent: list[str] = []
    for day, peak in ((1, 100), (2, 150)):
        (repo / FILE).write_text(baselines({"t.py::test_a": peak}))
        git(repo, "add", "-A")
        tree = git(repo, "write-tree").strip()
        stamp = f"T <t@example.com> {1793534400 + (day - 1) * 86400} +0000"
        lines = [f"tree {tree}", *(f"parent {p}" for p in parent[-1:]), f"author {stamp}", f"committer {stamp}", ""]
        raw = "\n".join(lines).encode() + b"\nodd \x1e record \x1b[31mred\x07 \xff\xfe bytes\n"
        done = subprocess.run(["git", "hash-object", "-t", "commit", "-w", "--stdin"], cwd=repo, input=raw,
                              capture_output=True, check=True)  # fmt: skip
        parent.append(done.stdout.decode().strip())
        git(repo, "update-ref", "HEAD", parent[-1])
    return repo, [git(repo, "rev-parse", "--short", sha).strip() for sha in parent]


ODD_SUBJECT = "odd \\x1e record \\x1b[31mred\\x07 \ufffd\ufffd bytes"
ODD_NAMES = ["données de mémoire.json", 'a "quoted"\tname.json', "sub dir/base line.json"]


@pytest.fixture(scope="module")
def names(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Baseline files whose names git quotes (a quote, a tab), a non-ASCII one, one with spaces in a folder."""
    repo = init(tmp_path_factory.mktemp("names") / "repo")
    shorts = []
    for day, peak in ((1, 100), (2, 150)):
        for name in ODD_NAMES:
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(baselines({"t.py::test_a": peak}))
        shorts.append(record(repo, f"c{day}", day))
    return repo, shorts


def test_odd_subjects_are_read_and_shown_escaped(
    odd: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, shorts = odd
    out = tmp_path / "all.json"
    html = tmp_path / "page.html"
    args = ["history", str(repo / FILE), "--json", str(out), "--html", str(html), "--sparklines"]
    assert main(args) == 0
    shown = capsys.readouterr().out
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", shown)
    assert f"+50 B  +50.0%      1         +50 B  {shorts[1]} 2026-11-02 odd \\x1e record \\x1b[31mred\\x07" in shown
    assert [c["subject"] for c in json.loads(out.read_text())["commits"]] == [ODD_SUBJECT, ODD_SUBJECT]
    steps = page(html).findall(".//section[@class='test']//details/table/tr")
    assert [td.text for td in steps[1]][:3] == [shorts[1], "2026-11-02", ODD_SUBJECT]


@pytest.mark.parametrize("name", ODD_NAMES)
def test_file_names_git_quotes_are_read(names: tuple[Path, list[str]], tmp_path: Path, name: str) -> None:
    repo, shorts = names
    assert points(repo, tmp_path, file=name) == [[shorts[0], 100], [shorts[1], 150]]


# ------------------------------------------------------------------ dates, percentages, outputs


@pytest.mark.parametrize(
    ("since", "why"),
    [
        ("2026-11-31", "day is out of range for month"),
        ("2026-02-29", "day is out of range for month"),
        ("2026-13-01", "month must be in 1..12"),
        ("2026-11-05 25:00", "hour must be in 0..23"),
    ],
)
def test_an_impossible_date_is_one_line(
    clean: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str], since: str, why: str
) -> None:
    repo, _ = clean
    assert main(["history", str(repo / FILE), "--since", since, "--max-growth", "10"]) == 2
    assert capsys.readouterr() == ("", f"pytest-gpumem history: error: --since {since}: no such date ({why})\n")


def test_a_percent_sign_is_accepted(clean: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    repo, _ = clean
    assert main(["history", str(repo / FILE), "--max-growth", "15%", "--slack", "0"]) == 1
    assert "(+100.0%, more than 15%)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--slack", "1X", "unknown unit 'X' in size '1X'"),
        ("--slack", "-1", "size must not be negative, got '-1'"),
        ("--max-growth", "x%", "expected a percentage like 10 or 10%, got 'x%'"),
    ],
)
def test_a_bad_slack_or_percentage_names_the_option_and_value(
    clean: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str], flag: str, value: str, why: str
) -> None:
    repo, _ = clean
    with pytest.raises(SystemExit) as stopped:
        main(["history", str(repo / FILE), "--max-growth", "10", flag, value])
    assert stopped.value.code == 2
    assert f"pytest-gpumem history: error: argument {flag}: {why}" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(
    ("first", "second"), [("--json", "--markdown"), ("--markdown", "--html"), ("--json", "--html")]
)
def test_two_outputs_on_one_path_are_refused(
    clean: tuple[Path, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str], first: str, second: str
) -> None:
    repo, _ = clean
    out = tmp_path / "out.txt"
    assert main(["history", str(repo / FILE), first, str(out), second, str(tmp_path / "." / "out.txt")]) == 2
    assert capsys.readouterr() == ("", (
        f"pytest-gpumem history: error: {second} {tmp_path}/out.txt is also the {first} output; "
        "give each output its own path\n"
    ))  # fmt: skip
    assert not out.exists()


# ------------------------------------------------------------------ the gate's byte slack, the Markdown


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A small test grows by a deliberate 650 KiB (+1160.7%); another's HTML-like phase name and subject."""
    repo = init(tmp_path_factory.mktemp("small") / "repo")
    first = save(repo, {"t.py::test_small": 56 * KIB}, "start", 1)
    doc = json.loads(baselines({"t.py::test_small": 706 * KIB}))
    doc["entries"]["t.py::test_small"]["tracker | cpu"]["phases"] = {"<b>forward</b>": 1}
    (repo / FILE).write_text(json.dumps(doc))
    return repo, [first, record(repo, "<img src=x onerror=alert(1)> | pipe", 2)]


def test_the_gate_has_the_baseline_gates_byte_slack(
    small: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    repo, shorts = small
    assert main(["history", str(repo / FILE), "--max-growth", "10"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no phase grew more than 10% + 1.0 MiB"
    assert main(["history", str(repo / FILE), "--max-growth", "10", "--slack", "512KiB"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "grew: t.py::test_small [tracker cpu] call: 56.0 KiB -> 706.0 KiB (+1160.7%, more than 10% + 512.0 KiB) "
        f"in 1 step: {shorts[1]} +650.0 KiB"
    )


def test_the_markdown_escapes_html_and_says_what_broke_the_gate(small: tuple[Path, list[str]], tmp_path: Path) -> None:
    repo, shorts = small
    md = tmp_path / "top.md"
    assert main(["history", str(repo / FILE), "--markdown", str(md), "--max-growth", "10", "--slack", "0"]) == 1
    text = md.read_text()
    assert "<" not in text and ">" not in text.replace("->", "")
    assert f"{shorts[1]} 2026-11-02 &lt;img src=x onerror=alert(1)&gt; \\| pipe" in text
    assert "&lt;b&gt;forward&lt;/b&gt;" in text
    rows = [line for line in text.splitlines() if line.startswith("| `t.py::test_small`")]
    assert [row.split("|")[3].strip() for row in rows] == ["over", "-", "-"]  # the call broke it, the phases not
    assert text.splitlines()[-1] == "1 series grew more than 10%: exit 1"
    assert main(["history", str(repo / FILE), "--markdown", str(md), "--max-growth", "10"]) == 0
    assert md.read_text().splitlines()[-1] == "No phase grew more than 10% + 1.0 MiB: exit 0"


def test_a_backtick_in_a_test_id_does_not_end_its_code_span(tmp_path: Path) -> None:
    repo = init(tmp_path / "repo")
    save(repo, {"t.py::test[`<i>`]": 1}, "start", 1)
    assert main(["history", str(repo / FILE), "--markdown", str(tmp_path / "md")]) == 0
    assert "| ``t.py::test[`<i>`]`` |" in (tmp_path / "md").read_text()


# ------------------------------------------------------------------ the page


def test_the_page_labels_the_largest_step_and_the_last_commit(tmp_path: Path) -> None:
    repo = init(tmp_path / "repo")
    peak, shorts = 1 << 20, []
    for day in range(1, 13):
        peak += 100 * KIB if day == 11 else KIB
        shorts.append(save(repo, {"t.py::test_a": peak}, f"c{day}", day))
    assert main(["history", str(repo / FILE), "--html", str(tmp_path / "page.html")]) == 0
    panel = page(tmp_path / "page.html").find(".//figure")
    assert panel is not None
    labels = [g.findtext("text") for g in panel.findall(".//g[@class='commit']")]
    assert {shorts[0], shorts[10], shorts[11]} <= set(labels)
    shift = {"start": 0, "middle": 30, "end": 60}  # a label is 60 px wide
    texts = panel.findall(".//g[@class='commit']/text[1]")
    lefts = sorted(float(t.get("x", 0)) - shift[t.get("class", "")] for t in texts)
    assert all(b - a >= 60 for a, b in itertools.pairwise(lefts))  # none over another


def test_a_change_of_a_few_bytes_is_not_drawn_as_a_cliff(tmp_path: Path) -> None:
    low, high, _ = byte_range(56 * KIB, 56 * KIB + 20)
    assert high - low >= (56 * KIB + 20) / 20
    repo = init(tmp_path / "repo")
    save(repo, {"t.py::test_a": 56 * KIB}, "start", 1)
    save(repo, {"t.py::test_a": 56 * KIB + 20}, "20 bytes more", 2)
    assert main(["history", str(repo / FILE), "--html", str(tmp_path / "page.html")]) == 0
    path = page(tmp_path / "page.html").find(".//figure//g[@class='series']/path")
    assert path is not None
    heights = [float(v) for v in re.findall(r"[ V](\d+\.\d)", path.get("d", ""))]
    assert max(heights) - min(heights) < 5  # pixels of a 134-pixel plot


def test_the_markdown_lists_every_row_over_the_gate_whatever_top(clean: tuple[Path, list[str]], tmp_path: Path) -> None:
    repo, _ = clean
    md = tmp_path / "top.md"
    args = ["history", str(repo / FILE), "--markdown", str(md), "--top", "1", "--max-growth", "50", "--slack", "0"]
    assert main(args) == 1
    rows = [line.split("|")[3:5] for line in md.read_text().splitlines() if line.startswith("| `t.py::test_a`")]
    assert [[cell.strip() for cell in row] for row in rows] == [["over", "call"], ["over", "forward"]]
