"""Builds offline.html, the `dvc plots show` page template with vega, vega-lite and vega-embed
inlined (no CDN). Not part of the pipeline: run once when the vendored versions change.

    cd /tmp && npm pack vega@5.33.1 vega-lite@5.23.0 vega-embed@6.29.0
    for f in vega-*.tgz; do mkdir -p "${f%.tgz}" && tar xzf "$f" -C "${f%.tgz}"; done
    python .dvc/plots/build_offline_template.py /tmp
"""

from __future__ import annotations

import sys
from pathlib import Path

LIBS = (("vega", "5.33.1"), ("vega-lite", "5.23.0"), ("vega-embed", "6.29.0"))

PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>lockstep plots</title>
    <!-- vega {v0}, vega-lite {v1}, vega-embed {v2} (BSD-3-Clause), inlined so the page renders offline -->
{inlined}
    <style>
        body {{ font-family: sans-serif; }}
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def main(packs_dir: Path) -> None:
    scripts = []
    for name, version in LIBS:
        js = (packs_dir / f"{name}-{version}" / "package" / "build" / f"{name}.min.js").read_text(encoding="utf-8")
        if "{plot_divs}" in js or "{scripts}" in js or "{refresh_tag}" in js or "</script" in js:
            raise ValueError(f"{name} {version} contains a template placeholder or </script>; it cannot be inlined")
        scripts.append(f"    <script>/* {name} {version} */\n{js}\n    </script>")
    page = PAGE.replace("{v0}", LIBS[0][1]).replace("{v1}", LIBS[1][1]).replace("{v2}", LIBS[2][1])
    page = page.replace("{{", "{").replace("}}", "}").replace("{inlined}", "\n".join(scripts))
    (Path(__file__).parent / "offline.html").write_text(page, encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
