#!/bin/bash
# Default run's validation accuracy, 86de38f against the working tree, 3 seeds, interleaved.
while ! grep -q "^EXIT" /tmp/ba/run.log; do sleep 10; done
source /work/main/.venv/bin/activate
export IMGTRAIN_DATA_DIR=/tmp/acc/data
for seed in 0 1 2; do
  if [ $((seed % 2)) -eq 0 ]; then order="base new"; else order="new base"; fi
  for tree in $order; do
    if [ $tree = base ]; then root=/tmp/base-86de38f; args="trainer.seed=$seed trainer.progress_bar=false";
    else root=/work/main; args="train.seed=$seed metrics.progress_bar=false"; fi
    dir=/tmp/acc/runs/$tree-s$seed
    echo "$(date +%H:%M:%S) $tree seed $seed: python train.py $args" >> /tmp/acc/log
    (cd $root && PYTHONPATH=$root/src python train.py $args hydra.run.dir=$dir > $dir.log 2>&1)
    python -c "import json;m=json.load(open('$dir/metrics.json'));print('$tree', $seed, m['val_acc'], m.get('best_val_acc'), m['images_per_sec'])" >> /tmp/acc/log
  done
done
echo DONE >> /tmp/acc/log
