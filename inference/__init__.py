"""decode.py's application: translating files with a trained model (token ids to
hypotheses is search/'s, below this and training/; other formats and runtimes,
StableHLO, CTranslate2 and OPUS-MT, are backends/).

    lines.py       lines of text <-> segments of ids <-> per-line hypotheses; read (whole or
                   in chunks), write, BLEU from summed statistics
    stream.py      the chunk loop of decode.py: read, translate, write in order, count
    targets.py     --prefix and --constraints: what each translation must hold
    scores.py      --score: given translations scored, a JSON object a line
    sentences.py   --long_lines=sentences: a line cut into sentences, each translated alone
    output.py      decode.py's output: FILE.partial, its progress record, resume or refuse
    progress.py    lines, lines/s, tokens/s and ETA on stderr
    alignment.py   word alignments from cross-attention
    plots.py       cross-attention heatmaps
    options.py     `DecodeOptions`, decode.py's settings, and their checks
    cli.py         decode.py's flags (one per DecodeOptions field) -> `DecodeOptions`
    translators.py which translator a job uses (workdir, export, CTranslate2, OPUS-MT)
                   and the devices' shardings
    processes.py   several processes on one job: process 0 writes, the others follow
    exports.py     --export and --export_ct2
    text.py        `Translator`: translate strings from Python, as decode.py does
    run.py         decode.py's command: `run(options)`

A training workdir is read back by training/workdir.py, the one module of training/
that inference/ imports. Nothing is imported here, so that importing one module loads
only what it needs.
"""
