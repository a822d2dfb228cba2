"""Whole-volume prediction for users' files and tools: NIfTI/DICOM volumes in, NIfTI out
with the input's geometry (``volumes.py``), and nnU-Net v2's predictor on whole volumes
(``nnunet.py``). Both run :func:`remat3d.predict` (``predicting.py``)."""
