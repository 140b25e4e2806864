import getpass
import signal
from pathlib import Path

from supervisor.datatypes import RestartWhenExitUnexpected
from supervisor.options import ServerOptions

PROGRAM = Path(__file__).parents[2] / "deploy" / "supervisor" / "cakemp.conf"


def load(tmp_path: Path):
    """The program's config as supervisord reads it: the project's file [include]d from a minimal supervisord.conf.

    The account and log directory are the two machine-specific values; they are swapped for
    the current user and tmp_path, since supervisor checks that both exist.
    """
    text = PROGRAM.read_text()
    assert "\nuser=cakemp\n" in text and "/var/log/supervisor/" in text
    (tmp_path / "cakemp.conf").write_text(
        text.replace("\nuser=cakemp\n", f"\nuser={getpass.getuser()}\n").replace("/var/log/supervisor/", f"{tmp_path}/")
    )
    main = tmp_path / "supervisord.conf"
    main.write_text(
        f"[supervisord]\nlogfile={tmp_path}/supervisord.log\npidfile={tmp_path}/supervisord.pid\n"
        "[include]\nfiles = cakemp.conf\n"
    )
    options = ServerOptions()
    options.realize(args=["-c", str(main)])
    [group] = options.process_group_configs
    [program] = group.process_configs
    return program


def test_supervisor_accepts_the_program_section(tmp_path):
    """supervisor's own config parser reads the program section and its multi-line environment."""
    program = load(tmp_path)
    assert program.name == "cakemp"
    assert program.command == "/opt/cakemp/bin/cakemp run"
    assert program.environment["CAKE_CLUSTER_KEY"]
    assert set(program.environment) >= {"CAKEMP_MODEL", "CAKEMP_TOPOLOGY", "CAKEMP_DRAIN_TIMEOUT"}


def test_stop_signals_the_front_and_kills_the_group_after_the_drain(tmp_path):
    """SIGTERM goes to the front alone, the group is SIGKILLed on timeout, and the timeout exceeds the drain."""
    program = load(tmp_path)
    assert program.stopsignal == signal.SIGTERM
    assert (program.stopasgroup, program.killasgroup) == (False, True)
    assert program.stopwaitsecs > int(program.environment["CAKEMP_DRAIN_TIMEOUT"])


def test_restarts_on_crashes_but_not_after_a_clean_stop_or_config_error(tmp_path):
    """Only unexpected exits are restarted, and exits 0 and 78 count as expected."""
    program = load(tmp_path)
    assert program.autorestart is RestartWhenExitUnexpected
    assert sorted(program.exitcodes) == [0, 78]
