//! The median and spread over rounds that the load harnesses report (`benches/load`, the TLS
//! bench, `bench-gateway`).

/// Median, min and max of a set of figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// The median (of the middle two for an even count), min and max of `values`; `None` if
/// there are none.
pub fn spread(mut values: Vec<f64>) -> Option<Stat> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let median = if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    };
    Some(Stat {
        median,
        min: values[0],
        max: values[n - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_spread() {
        let stat = |median, min, max| Some(Stat { median, min, max });
        assert_eq!(spread(vec![3.0, 1.0, 2.0]), stat(2.0, 1.0, 3.0));
        assert_eq!(spread(vec![4.0, 1.0, 2.0, 3.0]), stat(2.5, 1.0, 4.0));
        assert_eq!(spread(vec![7.0]), stat(7.0, 7.0, 7.0));
        assert_eq!(spread(vec![]), None);
    }
}
