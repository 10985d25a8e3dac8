#!/bin/bash
# r18_dataloader's row, data.augment_on=auto (crop on the device) against =workers, interleaved, 2 rounds
mkdir -p /tmp/clean /tmp/o && tar -xf .device/src.tar -C /tmp/clean && cd /tmp/clean
export PYTHONPATH=/tmp/site:/tmp/clean/src
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/machine.txt; nproc >> $OUT/machine.txt
ARGS="dataset=shapes dataset.num_val=1000 data.num_workers=15 model=resnet18_cifar dataset.image_size=32 data.batch_size=512 system.precision=bf16 train.max_steps=300 metrics.skip_first_steps=50 metrics.log_every_n_steps=25 train.epochs=1 dataset.num_train=158720 checkpoint.save=false metrics.progress_bar=false data_dir=/tmp/data"
for r in 1 2; do for a in auto workers; do
  d=/tmp/o/r$r-$a; echo "python train.py $ARGS data.augment_on=$a" > $OUT/r$r-$a.log
  timeout 80 python3 train.py $ARGS data.augment_on=$a hydra.run.dir=$d >> $OUT/r$r-$a.log 2>&1; echo "rc=$?" >> $OUT/r$r-$a.log
  cp $d/metrics.json $OUT/r$r-$a.metrics.json 2>/dev/null
  python3 -c "import json;m=json.load(open('$d/metrics.json'));print('r$r $a', round(m['images_per_sec']), round(m['images_per_sec_median']), m['images_per_sec_interval'], m.get('data_wait_frac'), m.get('gpu_util_mean'))" 2>&1 | tee -a $OUT/summary.txt
done; done
