"""Offline jobs that fit new weights to a loaded model: an MTP draft layer distilled from the
model's own generations (mtp.py, mtp_data.py), and calibrated int4 quantization (quantize.py).
Nothing in the inference path imports this package."""
