"""`python -m cakemp` is the `cakemp` command."""

from cakemp.cli import main

if __name__ == "__main__":  # spawned device processes re-import this module as __mp_main__
    main()
