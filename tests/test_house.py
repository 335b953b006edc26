"""The README's map of the house matches the house: its tree names every package of gptmini/
and nothing that is not there, every docs page is linked from it, every link and path the
pages name exists, the reading path's line count is the code's, and the architecture page's
table of who imports whom is the code's and points one way."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gptmini"
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BRANCH = re.compile(r"(?:[│ ] {3})*(?:[├└]── )?")  # the tree's drawing before a name


def prose(page: Path) -> str:
    """A page without its fenced code blocks (a `# comment` in bash is no heading)."""
    return re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.S | re.M)


def section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def tree_paths() -> list[str]:
    """The paths the README's tree names, as 'gptmini/attention/kernels/tiled.py'."""
    block = re.search(r"```text\n(.*?)```", section(REPO / "README.md", "The tree"), re.S)
    lines = block.group(1).splitlines()
    assert lines[0].strip() == "gptmini/", lines[0]
    stack, paths = ["gptmini"], []
    for line in filter(str.strip, lines[1:]):
        drawing = BRANCH.match(line).group(0)
        name = line[len(drawing):].split()[0]
        depth = len(drawing) // 4  # 1 for the package's own entries
        assert depth >= 1 and drawing.endswith("── "), f"not a tree entry: {line!r}"
        del stack[depth:]
        paths.append("/".join([*stack, name.rstrip("/")]))
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
    return paths


def test_every_path_the_tree_names_exists():
    missing = [p for p in tree_paths() if not (REPO / p).exists()]
    assert missing == [], f"the README's tree names {missing}, which gptmini/ does not have"


def test_the_tree_names_every_package_and_top_level_module():
    named = set(tree_paths())
    packages = {str(init.parent.relative_to(REPO)) for init in PACKAGE.rglob("__init__.py")}
    modules = {str(p.relative_to(REPO)) for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    unnamed = sorted((packages | modules) - named - {"gptmini"})
    assert unnamed == [], f"the README's tree does not name {unnamed}: add them to it"


def test_every_docs_page_is_linked_from_the_readme():
    readme = prose(REPO / "README.md")
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name}" not in readme]
    assert unlinked == []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_points_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", prose(file), re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_every_repository_path_the_pages_name_exists():
    """`gptmini/...`, `configs/...`, `bench/...`, `tests/...` in backticks: a file moved or
    renamed shows here, naming the page to update."""
    missing = []
    for page in PAGES:
        for path in re.findall(r"`((?:gptmini|configs|bench|tests|docs)/[\w./-]*)`",
                               page.read_text()):
            if not (REPO / path).exists():
                missing.append(f"{page.name}: {path}")
    assert missing == []


def test_the_reading_paths_line_count_is_the_codes():
    text = section(REPO / "README.md", "The reading path of an afternoon")
    stated = int(re.search(r"([\d,]+) lines", text).group(1).replace(",", ""))
    files = [*(PACKAGE / "attention").rglob("*.py"), *(PACKAGE / "model").rglob("*.py")]
    counted = sum(len(f.read_text().splitlines()) for f in files)
    assert abs(stated - counted) <= 0.1 * counted, (
        f"the README says {stated} lines, wc -l counts {counted}: measure again with the "
        "command it names and update the figure and the commit")
    assert "find gptmini/attention gptmini/model -name" in " ".join(text.split())


def imports_of(unit: Path) -> set[str]:
    """The gptmini packages and top-level modules that the files of `unit` import."""
    found = set()
    files = [unit] if unit.is_file() else unit.rglob("*.py")
    own = unit.name.removesuffix(".py")
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found |= {n.split(".")[1] for n in names if n.startswith("gptmini.")}
    return found - {own}


def test_the_architecture_pages_import_table_is_the_codes_and_points_one_way():
    table = section(REPO / "docs" / "architecture.md", "Which way dependencies point")
    rows = re.findall(r"^\| `([\w.]+)/?` \| (.+) \|$", table, re.M)
    assert rows, "no table of imports found"
    order = [name.removesuffix(".py") for name, _ in rows]
    for i, (name, imports) in enumerate(rows):
        stated = set(re.findall(r"`(\w+)`", imports))
        actual = imports_of(PACKAGE / name)
        assert stated == actual, f"{name}: the page says {sorted(stated)}, the code imports " \
                                 f"{sorted(actual)}"
        above = set(order[:i])
        assert stated <= above, f"{name} imports {sorted(stated - above)}, not above it"
    units = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    units |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert units == set(order), f"the table lacks {sorted(units - set(order))}"
