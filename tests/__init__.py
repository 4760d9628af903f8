"""weightd's tests.

Every test directory is a package (an ``__init__.py``, empty or a docstring), ``tests/``
included: pytest imports each test file by its dotted name (``tests.unit.plan.test_planner``),
so same-named files in different folders never collide, and helpers are imported the same
way (``from tests.conftest import run_daemon``, ``python -m tests.shm.worker``).
"""
