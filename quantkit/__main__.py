"""`python -m quantkit ...`: the CLI, as torchrun starts it (`torchrun --nproc-per-node N -m quantkit convert ...`)."""

from quantkit.cli import main

if __name__ == "__main__":
    main()
