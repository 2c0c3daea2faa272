"""The entry points: the Snakemake script jobs and the ``servegrid`` CLI (the same functions, two ways in),
the cell job, logging, and what a configuration's Slurm job asks for."""
