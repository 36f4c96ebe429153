#!/bin/bash
# The published layout at real shapes: convert a `synth --preset bench
# --layers 2 --experts 8` input (1.7 GB: stacked experts [8, 4608, 4608] and [8, 4608, 2304] per
# layer, the rest pass-through) with each scheme and output format, side by side with cp +
# sha256sum of the same bytes; wall, CPU and peak RSS per run (GNU time). Usage:
#   python -m inkling_quant.cli synth "$W/src" --preset bench --layers 2 --experts 8
#   W=/path/to/work tools/bench_real_shapes.sh > results.txt
set -u
export W=${W:-/work/bench}
for rep in 1 2; do
for case in "none" "default" "nvfp4" "mxfp8" "default-hf"; do
  rm -rf $W/out
  scheme=${case%-hf}; extra=""
  [ "$case" = "default-hf" ] && extra="--output-format modelopt-hf"
  /usr/bin/time -f "$case rep$rep wall %e s cpu %U+%S s maxrss %M KB" python -m inkling_quant.cli convert $W/src $W/out --scheme $scheme --default-activation-amax 4 --quiet $extra --max-shard-size 500MB 2>&1 | tail -1
done
rm -rf $W/cp; sync
/usr/bin/time -f "cp+sha256 rep$rep wall %e s" bash -c 'cp -r $W/src $W/cp && sha256sum $W/cp/*.safetensors > /dev/null' 2>&1 | tail -1
rm -rf $W/cp
done
