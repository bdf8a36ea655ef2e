"""Models in and out of other formats, and the translators that run them: what sits
between a trained model and another runtime (below inference/, which picks one; above
model/, data/ and search/, which they use).

    marian.py      an OPUS-MT / Marian model (either layout) read into ours
    ct2_export.py  a CTranslate2 model directory from one of ours
    ct2.py         translating with a CTranslate2 model (`CT2Translator`)
    stablehlo.py   a self-contained StableHLO translator (`export_translator`,
                   `ExportedTranslator`)

Nothing is imported here, so that importing one module loads only what it needs
(CTranslate2 is imported only where it runs).
"""
