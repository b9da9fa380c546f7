#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
import json

with open("/app/inventory.json") as f:
    items = json.load(f)["items"]
with open("/app/inventory.csv", "w", newline="") as f:
    out = csv.writer(f, lineterminator="\n")
    out.writerow(["sku", "name", "qty", "price", "currency", "tags"])
    for item in sorted(items, key=lambda i: i["sku"]):
        price = item["price"]
        out.writerow([item["sku"], item["name"], item["qty"], f"{price['amount']:.2f}", price["currency"],
                      ";".join(item["tags"])])
PY
