"""The README's Python example runs as written."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "..", "README.md")


def test_readme_python_example_runs():
    text = open(README, encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        namespace = {}
        exec(compile(block, "README.md", "exec"), namespace)
        assert namespace["stats"].loss > 0
        assert tuple(namespace["logits"].shape) == (4, 32, namespace["cfg"].vocab_size)
