"""GSM8K's reward in verl's signature (docs/guide.md): 1.0 when the number after the response's last
"####" is the ground truth, else 0.0. mrl calls it as verl does; "extracted" is what maj@K counts."""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"#### *(-?[0-9.,]+)", solution_str)
    answer = found[-1].replace(",", "").rstrip(".") if found else None
    return {"score": float(answer == ground_truth), "extracted": answer}
