"""Prints the shop's report: python3 main.py"""

from shop.report import report
from shop.users import get_user

if __name__ == "__main__":
    print(report())
    print("user 2 is", get_user(2))
