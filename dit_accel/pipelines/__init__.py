"""Whole diffusers pipelines: tiny offline builders, loading local folders, stage-timed runs, video files,
and frame quality metrics. One concern per module:

  tokenizer.py   a word-level tokenizer built in code (tiny pipelines never reach a hub)
  tiny_wan.py    a tiny random WanPipeline
  tiny_h3.py     a tiny random MiniMax-H3 modular pipeline (and its torchvision-free prompt processor)
  tiny_skyreels_v2.py, tiny_cogvideox.py   tiny random SkyReelsV2Pipeline and CogVideoXPipeline
  tiny_parts.py  the T5-family text encoder, word tokenizer and folder description they share
  tiny.py        the registry `make-tiny-pipeline` reads, and the defaults file it writes
  pipeline_folder.py   checking and opening a local pipeline folder
  stage_timer.py       per-stage timing from hooks    running.py  one call with an attention choice
  video_io.py    MP4 (and WAV) writing                 quality.py  per-frame PSNR and SSIM
  parallel.py    --ulysses: diffusers' context parallelism under torchrun
"""
