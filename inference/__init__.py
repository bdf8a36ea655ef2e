"""decode.py's application: translating files with a trained model (token ids to
hypotheses is search/'s, below this and training/; other formats and runtimes,
StableHLO, CTranslate2 and OPUS-MT, are backends/).

    lines.py       lines of text <-> segments of ids <-> per-line hypotheses; read (whole or
                   in chunks), write, BLEU from summed statistics
    stream.py      the chunk loop of decode.py: read, translate, write in order, count
    output.py      decode.py's output: FILE.partial, its progress record, resume or refuse
    progress.py    lines, lines/s, tokens/s and ETA on stderr
    alignment.py   word alignments from cross-attention
    plots.py       cross-attention heatmaps
    restore.py     a trained model back from a training workdir (the one import of training/)
    options.py     `DecodeOptions`, decode.py's settings, and their checks
    cli.py         decode.py's flags (one per DecodeOptions field) -> `DecodeOptions`
    run.py         decode.py's command: `run(options)`

Nothing is imported here, so that importing one module loads only what it needs.
"""
