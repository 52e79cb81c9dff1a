"""Short Python specs with hidden unit tests, generated from templates and constants.

Each task asks for one function; its hidden tests call that function on fixed inputs. The split puts each
(template, constant) pair in one split only, so held-out specs ask for variations never trained on.
"""

from __future__ import annotations

from typing import Any

# (spec, reference implementation body, test inputs); {k} is the task's constant
TEMPLATES: list[tuple[str, str, list[str]]] = [
    ("returns the number x multiplied by {k}", "return x * {k}", ["0", "1", "7", "-3"]),
    ("returns the number x plus {k}", "return x + {k}", ["0", "5", "-12", "100"]),
    (
        "returns True when the integer x is divisible by {k}, else False",
        "return x % {k} == 0",
        ["0", "{k}", "7", "24", "35"],
    ),
    (
        "returns the list xs with every element multiplied by {k}",
        "return [v * {k} for v in xs]",
        ["[]", "[1, 2]", "[0, -4, 9]"],
    ),
    ("returns the string s repeated {k} times", "return s * {k}", ["''", "'ab'", "'x'"]),
    (
        "returns the last {k} characters of the string s",
        "return s[-{k}:]",
        ["'abcdefghij'", "'hello world'", "'0123456789'"],
    ),
    (
        "returns the sum of the numbers in the list xs that are greater than {k}",
        "return sum(v for v in xs if v > {k})",
        ["[]", "[1, 5, 9, 12]", "[20, 3, 8]"],
    ),
    (
        "returns how many numbers in the list xs are smaller than {k}",
        "return sum(1 for v in xs if v < {k})",
        ["[]", "[1, 5, 9, 12]", "[20, 3, 8]"],
    ),
]
_ARG = ["x", "x", "x", "xs", "s", "s", "xs", "xs"]
_NAMES = ["solve", "compute", "transform", "answer"]
_CONSTANTS = list(range(2, 32))


def make_tasks() -> list[dict[str, Any]]:
    """Every (template, constant) task: the spec, the function name, the hidden tests and the template index."""
    tasks = []
    for index, (spec, body, inputs) in enumerate(TEMPLATES):
        for k in _CONSTANTS:
            name = _NAMES[(index + k) % len(_NAMES)]
            arg = _ARG[index]
            reference = f"def {name}({arg}):\n    {body.format(k=k)}\n"
            scope: dict[str, Any] = {}
            exec(reference, scope)  # our own reference code, to compute the expected outputs
            cases = [inp.format(k=k) for inp in inputs]
            tests = [(case, repr(scope[name](eval(case)))) for case in cases]
            tasks.append(
                {
                    "spec": f"Write a Python function `{name}({arg})` that {spec.format(k=k)}.",
                    "function": name,
                    "tests": tests,
                    "reference": reference,
                    "template": index,
                }
            )
    return tasks
