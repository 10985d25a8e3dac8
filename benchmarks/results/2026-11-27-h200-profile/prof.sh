#!/bin/bash
# r18_ceiling and r18_dataloader in one call, then r18_dataloader profiled (metrics.profile=true)
mkdir -p /tmp/clean /tmp/o && tar -xf .device/src.tar -C /tmp/clean && cd /tmp/clean
export PYTHONPATH=/tmp/site:/tmp/clean/src
R18="model=resnet18_cifar dataset.image_size=32 data.batch_size=512 system.precision=bf16 train.max_steps=300 metrics.skip_first_steps=50 metrics.log_every_n_steps=25 train.epochs=1 checkpoint.save=false metrics.progress_bar=false data_dir=/tmp/data"
LOADER="dataset=shapes dataset.num_val=1000 data.num_workers=15 dataset.num_train=158720"
run() { name=$1; shift; timeout 90 python3 train.py "$@" hydra.run.dir=/tmp/o/$name > $OUT/$name.log 2>&1; echo "rc=$?" >> $OUT/$name.log; }
run ceiling mode=compute dataset=synthetic $R18
run dataloader $LOADER $R18
run profiled $LOADER $R18 metrics.profile=true metrics.profile_steps=10
cd /tmp/o/profiled && tar -czf $OUT/profile.tar.gz profile 2>/dev/null; ls -la /tmp/o/profiled/profile >> $OUT/profiled.log
for n in ceiling dataloader profiled; do python3 -c "import json;m=json.load(open('/tmp/o/$n/metrics.json'));print('$n', round(m['images_per_sec']), round(m['images_per_sec_median'] or 0), m['images_per_sec_interval'], round(m.get('data_wait_frac') or 0,3), m.get('gpu_util_mean'))"; done
