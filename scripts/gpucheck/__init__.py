"""The GPU check (`make gpu-check`): the library's CUDA path, proven on a CUDA machine in one prepared run.

It runs the library directly (`lmgeo/`), not the stages: the CUDA machine cannot take Ray or DVC (see
`wheels`). `plan` lists what runs; `compare` holds each study's path on the device against the same call
on the CPU, `speed` the measurements, `compat` the import and private-API checks, `tolerances` how close
is close enough and why, `summary` the JSON and Markdown it writes under `$OUT`, `mamba_wheels` (with
`build_mamba_wheels.sh`) the build of Mamba's kernel wheels on that machine. Without CUDA it prints
"no CUDA: skipped" and exits 0; `--device cpu` runs the same plan on the CPU as a stand-in (the test suite
does, at tiny sizes), which proves the code path and measures nothing about a GPU.
"""
