"""The pytest plugin as a user's project sees it: pytester runs a separate pytest."""

import pytest
from helpers import USER_MLP

pytest_plugins = ["pytester"]

USER_TESTS = """
import pytest
from tpdp_verify.properties import flatten_roundtrip

def test_roundtrip(tpdp_pool, tpdp_impl, tpdp_profile):
    stats = flatten_roundtrip.run(tpdp_pool, tpdp_impl, tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples
    print("world", tpdp_pool.world_size, "impl", tpdp_impl, "profile", tpdp_profile.name)

@pytest.mark.tpdp(world_size=4)
def test_marker_picks_the_world_size(tpdp_pool):
    assert tpdp_pool.world_size == 4
"""


@pytest.mark.timeout(300)
def test_fixtures_options_and_marker_in_a_users_project(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-s", "--tpdp-impl", "reference", "--tpdp-profile", "smoke",
                                           "--strict-markers")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*world 2 impl reference profile smoke*"])


@pytest.mark.timeout(300)
def test_ini_keys_configure_the_plugin_and_the_command_line_wins(pytester):
    pytester.makeini("[pytest]\ntpdp_world_size = 4\ntpdp_impl = reference\ntpdp_profile = smoke\n")
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-s", "-k", "roundtrip")
    result.stdout.fnmatch_lines(["*world 4 impl reference profile smoke*"])
    result = pytester.runpytest_subprocess("-s", "-k", "roundtrip", "--tpdp-world-size", "2")
    result.stdout.fnmatch_lines(["*world 2 impl reference profile smoke*"])


@pytest.mark.timeout(300)
def test_a_divergence_fails_the_users_test_with_the_shrunk_case(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("--tpdp-profile", "smoke", "-k", "roundtrip",
                                           "--junitxml=report.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*requires_grad (ranks 0, 1)*", "*requires_grad=False*"])
    assert "requires_grad" in (pytester.path / "report.xml").read_text()


def test_a_bad_impl_is_one_clear_error(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("--tpdp-impl", "nope.nothing", "-k", "roundtrip")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*implementation 'nope.nothing' does not import*"])


def test_the_plugin_can_be_disabled(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:tpdp_verify", "-k", "roundtrip")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'tpdp_pool' not found*"])


USER_PLAN_TESTS = "import pytest\n" + USER_MLP + """

def test_my_plan(tpdp):
    report = tpdp.verify_plan(make_model, {"up": ColwiseParallel(), "down": RowwiseParallel()}, input_fn=inputs)
    print("mesh", report.case.mesh_shape, "compared", sum(x.compared for x in report.lines))

@pytest.mark.tpdp(mesh=(2, 2))
def test_my_plan_on_four_ranks(tpdp, tpdp_pool):
    report = tpdp.verify_plan(make_model, {"up": ColwiseParallel(), "down": RowwiseParallel()}, input_fn=inputs, steps=1)
    print("mesh", report.case.mesh_shape, "world", tpdp_pool.world_size)

def test_my_swapped_plan(tpdp):
    tpdp.verify_plan(make_model, {"up": RowwiseParallel(), "down": ColwiseParallel()}, input_fn=inputs, steps=1)

def test_my_typo(tpdp):
    tpdp.verify_plan(make_model, {"upp": ColwiseParallel(), "down": RowwiseParallel()}, input_fn=inputs)
"""


@pytest.mark.timeout(300)
def test_the_tpdp_fixture_verifies_a_users_plan(pytester):
    pytester.makepyfile(test_plans=USER_PLAN_TESTS)
    result = pytester.runpytest_subprocess("-s", "--tpdp-impl", "reference", "--junitxml=plans.xml")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines_random([
        "*mesh (1, 2) compared *",
        "*mesh (2, 2) world 4",
        "*DIVERGES*",
        "*trains without an exception*FAIL*",
        "*in the forward of up: RuntimeError*",
        "*tpdp-verify: plan key 'upp' matches no module of the model; did you mean 'up'?*",
    ])
    assert "in the forward of up" in (pytester.path / "plans.xml").read_text()
    result = pytester.runpytest_subprocess("--tpdp-impl", "reference", "-x", "-k", "swapped or typo")
    result.assert_outcomes(failed=1)


def test_a_mistyped_marker_keyword_is_one_clear_error(pytester):
    """``world_sise=4`` used to run the test on the default pool: now a usage error, naming the
    test and the keyword meant, before any test runs."""
    pytester.makepyfile(test_user="""
import pytest

@pytest.mark.tpdp(world_sise=4)
def test_four(tpdp_pool):
    assert tpdp_pool.world_size == 4
""")
    result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_user.py::test_four: the tpdp marker takes no keyword 'world_sise'; "
                                 "did you mean 'world_size'?*"])
    assert "Traceback" not in result.stderr.str() and "passed" not in result.stdout.str()
